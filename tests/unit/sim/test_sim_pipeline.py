"""The pipeline simulator's invariants, checked on its timeline (relayrl.sim.pipeline)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from relayrl.sim.durations import EpisodeModel
from relayrl.sim.pipeline import (
    FAILED,
    FINISHED,
    RUNNING,
    TIMED_OUT,
    TRUNCATED,
    DurationsExhausted,
    PipelineConfig,
    SimResult,
    simulate,
)

SEED_CONFIG = PipelineConfig(n_slots=64, batch_size=64, train_time_s=60.0, sync_time_s=10.0)
DURATIONS = EpisodeModel().durations(0, 8000)

# A spread of designs and options every invariant below must hold for.
CONFIGS = {
    "sync": PipelineConfig.for_design("sync"),
    "one_step_drain": PipelineConfig.for_design("one_step_drain"),
    "partial_eta1": PipelineConfig(eta=1),
    "partial_eta3": PipelineConfig(eta=3),
    "partial_eta4_drain": PipelineConfig(eta=4, drain=True),
    "drop_stale": PipelineConfig(eta=1, drop_stale=True),
    "timeout_truncate": PipelineConfig(eta=1, timeout_s=150.0),
    "timeout_drop": PipelineConfig(eta=2, timeout_s=150.0, timeout_policy="drop"),
    "failures_drop": PipelineConfig(eta=1, failure_hazard_per_s=1 / 500),
    "failures_retry": PipelineConfig(eta=1, failure_hazard_per_s=1 / 500, failure_policy="retry"),
    "trainer_waits": PipelineConfig(eta=2, train_during_sync=False),
    "trainer_bound": PipelineConfig(eta=2, train_time_s=150.0),  # finished rollouts queue up
    "small_uneven": PipelineConfig(n_slots=12, batch_size=20, eta=2, steps=15, sync_time_s=0.0),
}


def run(config: PipelineConfig, durations: np.ndarray = DURATIONS) -> SimResult:
    return simulate(config, durations)


@pytest.fixture(scope="module", params=list(CONFIGS))
def result(request: pytest.FixtureRequest) -> SimResult:
    return run(CONFIGS[request.param])


def test_sync_design_is_partial_and_drain_with_eta_0_exactly() -> None:
    sync = run(PipelineConfig.for_design("sync")).to_json()
    partial = run(PipelineConfig(eta=0, drain=False)).to_json()
    drain = run(PipelineConfig(eta=0, drain=True)).to_json()
    for other in (partial, drain):
        assert {k: v for k, v in other.items() if k not in ("config", "design")} == {
            k: v for k, v in sync.items() if k not in ("config", "design")
        }


def test_sync_steps_are_the_batch_maximum_plus_train_plus_sync() -> None:
    """Step k waits for the slowest of rollouts kB..(k+1)B-1, trains, then syncs (not after
    the last step: the makespan ends with the last train step)."""
    config = replace(SEED_CONFIG, eta=0, steps=10)
    result = run(config)
    batches = DURATIONS[: 10 * 64].reshape(10, 64)
    expected = batches.max(axis=1).sum() + 10 * 60.0 + 9 * 10.0
    assert result.makespan_s == pytest.approx(expected, rel=1e-12)
    assert result.rollouts_per_hour == pytest.approx(640 / expected * 3600)
    assert result.utilisation == pytest.approx(batches.sum() / (64 * expected))
    assert result.staleness_histogram == {0: 640}


def test_results_are_consistent(result: SimResult) -> None:
    c, timeline = result.config, result.timeline
    assert result.num_trained == c.steps * c.batch_size
    assert sum(result.staleness_histogram.values()) == result.num_trained
    assert result.makespan_s == timeline.train_steps[-1].end_s == timeline.makespan_s
    assert result.rollouts_per_hour == pytest.approx(result.num_trained / result.makespan_s * 3600)
    assert [s.step for s in timeline.train_steps] == list(range(c.steps))
    assert result.num_launched == len({s.rollout for s in timeline.rollouts})
    assert result.num_in_flight_at_end == sum(s.ended == RUNNING for s in timeline.rollouts)


def test_no_rollout_is_trained_twice_and_each_finished_before_its_step(result: SimResult) -> None:
    timeline = result.timeline
    trained = [s for s in timeline.rollouts if s.trained_step is not None]
    assert len(trained) == result.num_trained
    assert len({s.rollout for s in trained}) == len(trained)
    per_step = Counter(s.trained_step for s in trained)
    assert set(per_step.values()) == {result.config.batch_size}
    for span in trained:
        assert span.ended in (FINISHED, TRUNCATED)
        assert span.end_s <= timeline.train_steps[span.trained_step].start_s


def test_each_step_takes_the_earliest_finished_rollouts(result: SimResult) -> None:
    # (drop-stale discards stale early finishers instead of training them)
    spans = [
        s
        for s in result.timeline.rollouts
        if s.ended in (FINISHED, TRUNCATED) and not s.dropped_stale
    ]
    queued = 0
    for step in result.timeline.train_steps:
        batch = [s.end_s for s in spans if s.trained_step == step.step]
        waiting = [
            s.end_s
            for s in spans
            if s.end_s <= step.start_s and (s.trained_step is None or s.trained_step > step.step)
        ]
        if waiting:
            assert max(batch) <= min(waiting)
        queued += len(waiting)
    if result.config.train_time_s >= 150:
        assert queued > 0  # the check did bite


def test_slots_run_one_rollout_at_a_time_and_utilisation_is_at_most_1(result: SimResult) -> None:
    by_slot: dict[int, list] = {}
    for span in result.timeline.rollouts:
        assert 0 <= span.slot < result.config.n_slots
        assert span.start_s <= span.end_s <= result.makespan_s
        by_slot.setdefault(span.slot, []).append(span)
    for spans in by_slot.values():
        spans.sort(key=lambda s: s.start_s)
        for before, after in itertools.pairwise(spans):
            assert before.end_s <= after.start_s
    busy = sum(s.end_s - s.start_s for s in result.timeline.rollouts)
    assert result.utilisation == pytest.approx(busy / (result.config.n_slots * result.makespan_s))
    assert 0 < result.utilisation <= 1


def test_staleness_is_trainer_version_minus_launching_version(result: SimResult) -> None:
    trained = [s for s in result.timeline.rollouts if s.trained_step is not None]
    staleness = [s.trained_step - s.version for s in trained]
    assert min(staleness) >= 0 and result.staleness_max == max(staleness)
    assert Counter(staleness) == result.staleness_histogram
    assert result.staleness_mean == pytest.approx(np.mean(staleness))


def test_deterministic() -> None:
    config = CONFIGS["failures_retry"]
    assert run(config).to_json() == run(config).to_json()
    other = run(replace(config, failure_seed=1)).to_json()
    assert other != run(config).to_json()


def test_no_launch_during_a_sync_and_drain_never_overlaps_a_sync_with_generation() -> None:
    for name in ("one_step_drain", "partial_eta4_drain"):
        result = run(CONFIGS[name])
        assert result.timeline.syncs
        for sync in result.timeline.syncs:
            for span in result.timeline.rollouts:
                assert span.end_s <= sync.start_s or span.start_s >= sync.end_s, (name, span)
    for result in (run(CONFIGS["partial_eta1"]), run(CONFIGS["partial_eta3"])):
        overlapping = 0
        for sync in result.timeline.syncs:
            for span in result.timeline.rollouts:
                assert not sync.start_s < span.start_s < sync.end_s
                overlapping += span.start_s < sync.start_s < span.end_s
        assert overlapping > 0  # partial rollouts do cross syncs


def test_partial_syncs_push_in_flight_rollouts_by_exactly_the_sync_time() -> None:
    result = run(replace(SEED_CONFIG, eta=2, sync_time_s=17.0))
    syncs = [s.start_s for s in result.timeline.syncs]
    pushed = 0
    for span in result.timeline.rollouts:
        if span.ended == RUNNING:
            continue
        crossed = sum(span.start_s <= start < span.end_s for start in syncs)
        pushed += crossed > 0
        assert span.end_s - span.start_s == pytest.approx(span.duration_s + 17.0 * crossed)
    assert pushed > 100


def test_the_throttle_is_never_exceeded() -> None:
    for config in (CONFIGS["partial_eta1"], CONFIGS["partial_eta3"], CONFIGS["one_step_drain"]):
        result = run(config)
        sync_ends = np.array([s.end_s for s in result.timeline.syncs])
        first = [s for s in result.timeline.rollouts if s.attempt == 0]
        at_bound = 0
        for span in first:
            version = int((sync_ends <= span.start_s).sum())
            assert span.version == version
            bound = (version + 1 + config.eta) * config.batch_size
            assert span.rollout < bound  # launch index = launched before it
            at_bound += span.rollout == bound - 1
        if config.eta == 1:
            assert at_bound > 0  # the throttle does bind (at eta >= 2, 64 slots rarely reach it)


def test_drop_stale_keeps_trained_staleness_within_eta() -> None:
    plain, dropping = run(CONFIGS["partial_eta1"]), run(CONFIGS["drop_stale"])
    assert plain.staleness_max > 1
    assert dropping.staleness_max <= 1
    assert dropping.num_dropped_stale > 0
    assert dropping.num_dropped == dropping.num_dropped_stale
    dropped = [s for s in dropping.timeline.rollouts if s.dropped_stale]
    assert len(dropped) == dropping.num_dropped_stale
    assert all(s.trained_step is None for s in dropped)


def test_retries_launch_the_same_duration_again_on_the_same_slot() -> None:
    result = run(CONFIGS["failures_retry"])
    attempts: dict[int, list] = {}
    for span in result.timeline.rollouts:
        attempts.setdefault(span.rollout, []).append(span)
    retried = [spans for spans in attempts.values() if len(spans) > 1]
    assert retried and result.num_retries == sum(len(s) - 1 for s in retried)
    for spans in retried:
        assert [s.attempt for s in spans] == list(range(len(spans)))
        assert len({s.slot for s in spans}) == 1 and len({s.duration_s for s in spans}) == 1
        for failed, again in itertools.pairwise(spans):
            assert failed.ended == FAILED and again.start_s == failed.end_s
    assert result.num_failed == sum(s.ended == FAILED for s in result.timeline.rollouts)
    assert result.num_dropped == 0
    assert 0 < result.failed_busy_s < result.busy_s
    assert result.retry_cost == pytest.approx(result.failed_busy_s / result.busy_s)


def test_dropped_failures_are_never_trained_and_favour_long_rollouts() -> None:
    config = replace(CONFIGS["failures_drop"], eta=0, steps=60, failure_hazard_per_s=1 / 1000)
    result = run(config, EpisodeModel().durations(1, 30_000))
    failed = [s for s in result.timeline.rollouts if s.ended == FAILED]
    assert failed and all(s.trained_step is None for s in failed)
    assert result.num_failed == result.num_dropped == len(failed)
    assert all(s.end_s - s.start_s < s.duration_s for s in failed)
    # a constant hazard fails long rollouts more: the survivors are shorter
    assert result.trained_duration_mean_s < result.launched_duration_mean_s - 2


def test_timeout_truncate_caps_the_running_time() -> None:
    config = replace(SEED_CONFIG, eta=0, timeout_s=150.0)
    result = run(config)
    truncated = [s for s in result.timeline.rollouts if s.ended == TRUNCATED]
    assert truncated and result.num_truncated == len(truncated)
    for span in truncated:
        assert span.duration_s > 150.0
        assert span.end_s - span.start_s == pytest.approx(150.0)
    assert all(s.end_s - s.start_s <= 150.0 + 1e-9 for s in result.timeline.rollouts)
    assert result.num_dropped == 0
    assert result.rollouts_per_hour > run(replace(config, timeout_s=None)).rollouts_per_hour


def test_timeout_drop_discards_cut_rollouts_and_frees_their_slots() -> None:
    result = run(CONFIGS["timeout_drop"])
    cut = [s for s in result.timeline.rollouts if s.ended == TIMED_OUT]
    assert cut and result.num_dropped_timeout == len(cut) == result.num_dropped
    assert all(s.trained_step is None and s.duration_s > 150.0 for s in cut)
    assert all(
        s.duration_s <= 150.0 for s in result.timeline.rollouts if s.trained_step is not None
    )


def test_a_trainer_that_waits_for_its_sync_never_trains_during_one() -> None:
    waits = run(replace(CONFIGS["one_step_drain"], train_during_sync=False))
    overlaps = run(CONFIGS["one_step_drain"])

    def overlapping(result: SimResult) -> int:
        return sum(
            t.start_s < s.end_s and s.start_s < t.end_s
            for t in result.timeline.train_steps
            for s in result.timeline.syncs
        )

    assert overlapping(waits) == 0
    assert overlapping(overlaps) > 0
    # step k + 1 starts only once the weights of step k are published
    for sync, step in zip(waits.timeline.syncs, waits.timeline.train_steps[1:], strict=False):
        assert step.start_s >= sync.end_s


def test_more_staleness_buys_throughput() -> None:
    sync, eta1, eta2 = (run(PipelineConfig(eta=eta)) for eta in (0, 1, 2))
    assert sync.rollouts_per_hour < eta1.rollouts_per_hour < eta2.rollouts_per_hour
    assert eta1.trained_duration_mean_s < sync.trained_duration_mean_s


def test_running_out_of_durations_says_how_many_are_needed() -> None:
    config = PipelineConfig(eta=1, steps=20)
    with pytest.raises(DurationsExhausted, match="durations") as caught:
        simulate(config, DURATIONS[:500])
    assert caught.value.given == 500 and caught.value.needed > 500
    simulate(config, DURATIONS[: config.durations_needed()])  # the bound is enough


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_slots": 0}, "n_slots"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"train_time_s": 0.0}, "train_time_s"),
        ({"sync_time_s": -1.0}, "sync_time_s"),
        ({"sync_time_s": float("nan")}, "sync_time_s"),
        ({"steps": 0}, "steps"),
        ({"eta": -1}, "eta"),
        ({"eta": True}, "eta"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_policy": "cut"}, "timeout_policy"),
        ({"failure_hazard_per_s": -0.1}, "failure_hazard_per_s"),
        ({"failure_policy": "ignore"}, "failure_policy"),
    ],
)
def test_invalid_configs_say_which_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        PipelineConfig(**changes)


def test_designs() -> None:
    assert PipelineConfig.for_design("sync").eta == 0
    drain = PipelineConfig.for_design("one_step_drain", n_slots=8)
    assert (drain.eta, drain.drain, drain.n_slots, drain.design) == (1, True, 8, "one_step_drain")
    assert PipelineConfig.for_design("partial", eta=3).design == "partial"
    with pytest.raises(ValueError, match="fixes eta=0"):
        PipelineConfig.for_design("sync", eta=2)
    with pytest.raises(ValueError, match="fixes eta=1"):
        PipelineConfig.for_design("one_step_drain", eta=2)
    with pytest.raises(ValueError, match="design must be one of"):
        PipelineConfig.for_design("async")


@pytest.mark.parametrize(
    "durations", [np.ones((4, 4)), np.array([1.0, -2.0]), np.array([1.0, np.inf])]
)
def test_bad_durations(durations: np.ndarray) -> None:
    with pytest.raises(ValueError, match="durations must"):
        simulate(PipelineConfig(), durations)


def test_to_json_is_json() -> None:
    import json

    data = json.loads(json.dumps(run(CONFIGS["failures_retry"]).to_json()))
    assert data["design"] == "partial" and data["config"]["failure_policy"] == "retry"
    assert data["num_trained"] == 20 * 64
    assert sum(data["staleness_histogram"].values()) == 20 * 64
    assert len(data["timeline"]["rollouts"]) > data["num_launched"]
