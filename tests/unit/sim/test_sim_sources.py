"""Where durations come from (relayrl.sim.sources): files, histograms, the model, and the
simulation that asks a source for as many as it needs. (The Prometheus source against a real
Prometheus: tests/integration/cli/test_sim_cli.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relayrl.core.ports import free_port
from relayrl.sim.durations import EpisodeModel
from relayrl.sim.pipeline import PipelineConfig
from relayrl.sim.sources import (
    PROMETHEUS_METRIC,
    HistogramSource,
    MeasuredSource,
    ModelSource,
    _histogram,
    histogram_from_prometheus,
    model_with,
    parse_durations_file,
    simulate_source,
)


def test_a_file_of_one_duration_per_line(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("# measured\n12.5\n\n  7\n3e2\n")
    assert parse_durations_file(path).tolist() == [12.5, 7.0, 300.0]


def test_a_json_list(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text("[1, 2.5, 40]")
    assert parse_durations_file(path).tolist() == [1.0, 2.5, 40.0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10\n20\nabc\n", r"d line 3: 'abc' is not a duration"),
        ("10\n-5\n", r"d line 2: '-5' is not a finite duration >= 0"),
        ("10\nnan\n", r"d line 2"),
        ("# nothing\n\n", r"holds no durations"),
        ("[1, true]", r"d: item 1: True is not a duration"),
        ("[1, 2", r"not valid JSON"),
        ("[[1]]", r"item 0"),
    ],
)
def test_bad_files_say_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "d"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse_durations_file(path)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read .*nope\.txt: No such file"):
        parse_durations_file(tmp_path / "nope.txt")


def test_measured_durations_replay_in_order_then_bootstrap() -> None:
    values = np.array([5.0, 50.0, 500.0, 7.0])
    source = MeasuredSource(values, "test")
    assert source.durations(3, seed=0).tolist() == [5.0, 50.0, 500.0]
    long = source.durations(10_000, seed=0)
    assert long[:4].tolist() == values.tolist()
    assert set(long.tolist()) == set(values.tolist())
    # prefix-stable, and the seed picks the resample
    assert np.array_equal(source.durations(5000, seed=0), long[:5000])
    assert not np.array_equal(source.durations(5000, seed=1), long[:5000])
    assert "bootstrap" in source.notes()[0]


def histogram() -> HistogramSource:
    # 10 in [0, 10], 20 in (10, 20], 10 in (20, 40], 10 above 40 (the +Inf bucket)
    return HistogramSource(np.array([10.0, 20.0, 40.0]), np.array([10.0, 30.0, 40.0, 50.0]), "t")


def test_the_inverse_cdf_interpolates_inside_buckets() -> None:
    source = histogram()
    u = np.array([0.0, 0.1, 0.2, 0.4, 0.6, 0.7, 0.79, 0.8, 0.99])
    expected = [0.0, 5.0, 10.0, 15.0, 20.0, 30.0, 39.0, 40.0, 40.0]
    assert source.quantile(u) == pytest.approx(expected)


def test_sampling_a_histogram_follows_its_cdf() -> None:
    durations = histogram().durations(40_000, seed=3)
    assert np.mean(durations <= 10.0) == pytest.approx(0.2, abs=0.01)
    assert np.mean(durations <= 20.0) == pytest.approx(0.6, abs=0.01)
    assert np.mean(durations == 40.0) == pytest.approx(0.2, abs=0.01)  # the +Inf bucket
    assert np.median(durations) == pytest.approx(17.5, abs=0.5)
    assert np.array_equal(histogram().durations(1000, seed=3), durations[:1000])


def test_the_inf_bucket_is_reported() -> None:
    (note,) = histogram().notes()
    assert "10 of 50 rollouts (20.0%)" in note and "sampled as 40 s" in note
    no_tail = HistogramSource(np.array([10.0]), np.array([4.0, 4.0]), "t")
    assert no_tail.notes() == []


def series(le: str, value: float) -> dict:
    return {"metric": {"le": le}, "value": [1700000000.0, str(value)]}


def test_a_prometheus_result_becomes_a_histogram() -> None:
    result = [series("+Inf", 9.9), series("20", 6.0), series("10", 2.0), series("40", 5.9)]
    source = _histogram(result, "p")
    assert source.upper_bounds_s.tolist() == [10.0, 20.0, 40.0]
    # increase() extrapolates each bucket alone; the counts are made cumulative again
    assert source.cumulative.tolist() == [2.0, 6.0, 6.0, 9.9]


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([], f"no {PROMETHEUS_METRIC}_bucket samples"),
        ([series("10", 1.0)], "no \\+Inf bucket"),
        ([series("10", 0.0), series("+Inf", 0.0)], "no rollout ended"),
    ],
)
def test_bad_prometheus_results(result: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _histogram(result, "p")


def test_prometheus_arguments_are_checked_before_asking() -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        histogram_from_prometheus("http://127.0.0.1:9", "1 hour")
    with pytest.raises(ValueError, match="must start with http"):
        histogram_from_prometheus("127.0.0.1:9090", "1h")


def test_an_unreachable_prometheus() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"cannot reach Prometheus at {url}"):
        histogram_from_prometheus(url, "1h", timeout_s=5)


def test_model_overrides() -> None:
    model = model_with(["turn_p=0.2", "max_turns=10"])
    assert model == EpisodeModel(turn_p=0.2, max_turns=10)
    assert ModelSource(model).describe() == "EpisodeModel(turn_p=0.2, max_turns=10)"
    assert ModelSource(EpisodeModel()).describe() == "EpisodeModel()"
    with pytest.raises(ValueError, match="NAME one of turn_p"):
        model_with(["turns=3"])
    with pytest.raises(ValueError, match=r"max_turns: .2\.5. is not a number"):
        model_with(["max_turns=2.5"])
    with pytest.raises(ValueError, match="turn_p must be in"):
        model_with(["turn_p=2"])


def test_the_model_source_is_the_episode_model() -> None:
    source = ModelSource(EpisodeModel())
    assert np.array_equal(source.durations(100, seed=4), EpisodeModel().durations(4, 100))


def test_simulate_source_asks_for_more_durations_when_rollouts_are_discarded() -> None:
    config = PipelineConfig(eta=0, steps=5, failure_hazard_per_s=1 / 100)  # most fail
    result = simulate_source(config, ModelSource(EpisodeModel()), seed=0)
    assert result.num_trained == 5 * 64
    first_ask = config.durations_needed() * 3 // 2 + config.n_slots
    assert result.num_launched > first_ask


def test_simulate_source_gives_up_when_nothing_can_finish() -> None:
    config = PipelineConfig(eta=0, steps=2, timeout_s=1.0, timeout_policy="drop")
    source = MeasuredSource(np.array([10.0, 20.0]), "t")
    with pytest.raises(ValueError, match="discarded nearly every rollout"):
        simulate_source(config, source, seed=0)
