"""`relayrl sim`, run as the real console script; and its Prometheus source against a real
Prometheus that scrapes a real prometheus_client histogram."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from relayrl.core.ports import free_port
from relayrl.sim.sources import PROMETHEUS_METRIC, histogram_from_prometheus
from relayrl_testkit.helpers import cli
from relayrl_testkit.helpers.prometheus_server import PrometheusServer


def relayrl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return cli.run("relayrl", "sim", *args, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess[str], text: str) -> None:
    cli.assert_one_line_error(result, "relayrl sim", text)
    assert result.stdout == ""


def test_a_run_writes_its_json_and_its_plot(tmp_path: Path) -> None:
    result = relayrl(
        "--design",
        "one_step_drain",
        "--steps",
        "6",
        "--json",
        str(tmp_path / "out.json"),
        "--plot",
        str(tmp_path / "out.png"),
    )
    assert result.returncode == 0, result.stderr
    for text in ("rollouts/hour", "slot utilisation", "staleness (trained)  mean", "dropped"):
        assert text in result.stdout
    assert "mean duration        trained" in result.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    run = data["result"]
    assert data["durations"]["source"] == "EpisodeModel()" and data["durations"]["seed"] == 0
    assert run["design"] == "one_step_drain" and run["config"]["eta"] == 1
    assert run["num_trained"] == 6 * 64 and run["staleness_max"] <= 1
    assert f"{run['rollouts_per_hour']:,.0f}" in result.stdout
    assert len(run["timeline"]["train_steps"]) == 6 and run["timeline"]["rollouts"]
    png = (tmp_path / "out.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_seed_chooses_the_rollouts(tmp_path: Path) -> None:
    def rate(*args: str) -> str:
        result = relayrl("--design", "sync", "--steps", "3", *args)
        assert result.returncode == 0, result.stderr
        return next(line for line in result.stdout.splitlines() if line.startswith("rollouts"))

    assert rate("--seed", "1") == rate("--seed", "1") != rate("--seed", "2")


def test_a_durations_file_and_options(tmp_path: Path) -> None:
    path = tmp_path / "durations.txt"
    path.write_text("\n".join(str(d) for d in [30, 60, 90, 600] * 10) + "\n")
    result = relayrl(
        "--durations-file",
        str(path),
        "--eta",
        "2",
        "--steps",
        "4",
        "--slots",
        "16",
        "--batch-size",
        "8",
        "--timeout-s",
        "300",
        "--timeout-policy",
        "drop",
        "--failure-hazard-per-s",
        "0.002",
        "--failure-policy",
        "retry",
        "--no-train-during-sync",
    )
    assert result.returncode == 0, result.stderr
    assert "40 measured durations from" in result.stdout and "bootstrap" in result.stdout
    assert "timeout 300 s (drop)" in result.stdout and "trainer waits for syncs" in result.stdout
    assert "timed out" in result.stdout and "retries" in result.stdout


def test_recommend(tmp_path: Path) -> None:
    result = relayrl(
        "--recommend",
        "--train-time-s",
        "15",
        "--sync-time-s",
        "3",
        "--slots",
        "16",
        "--batch-size",
        "16",
        "--repeats",
        "2",
        "--json",
        str(tmp_path / "sweep.json"),
        "--plot",
        str(tmp_path / "sweep.png"),
    )
    assert result.returncode == 0, result.stderr
    assert "the bound is" in result.stdout and "(generation)" in result.stdout
    assert "partial: eta=" in result.stdout and "partial + drop-stale: eta=" in result.stdout
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [row["eta"] for row in data["rows"]] == list(range(9))
    assert data["recommended_eta"]["partial"] is not None
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def bad_arguments(tmp_path: Path) -> list[tuple[list[str], str]]:
    bad_file = tmp_path / "bad.txt"
    bad_file.write_text("12\n1O\n")
    nobody = f"http://127.0.0.1:{free_port()}"
    return [
        (["--slots", "0"], "--slots must be >= 1"),
        (["--slots", "many"], "argument --slots: invalid int value"),
        (["--train-time-s", "-3"], "--train-time-s must be > 0"),
        (["--design", "sync", "--eta", "2"], "fixes --eta 0"),
        (["--design", "sync", "--drain"], "--drain"),
        (["--design", "async"], "invalid choice"),
        (["--durations-file", str(tmp_path / "nope.txt")], "No such file"),
        (["--durations-file", str(bad_file)], "bad.txt line 2: '1O' is not a duration"),
        (["--durations-from-prometheus", nobody], f"cannot reach Prometheus at {nobody}"),
        (["--durations-from-prometheus", "localhost:9090"], "must start with http"),
        (["--durations-file", str(bad_file), "--durations-from-prometheus", nobody], "not allowed"),
        (["--window", "1h"], "--window needs --durations-from-prometheus"),
        (["--durations-from-prometheus", nobody, "--window", "an hour"], "not a Prometheus"),
        (["--timeout-policy", "drop"], "--timeout-policy needs --timeout-s"),
        (["--failure-policy", "retry"], "--failure-policy needs --failure-hazard-per-s"),
        (["--model-param", "turns=3"], "NAME one of turn_p"),
        (["--recommend"], "--recommend needs --train-time-s"),
        (["--recommend", "--train-time-s", "60", "--eta", "2"], "drop --eta"),
        (["--repeats", "3"], "--repeats goes with"),
        (["--steps", "2", "--json", str(tmp_path / "no" / "dir.json")], "no directory"),
    ]


def test_mistakes_are_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, text in bad_arguments(tmp_path):
        assert_one_line_error(relayrl(*args), text)


# -- the Prometheus source against a real Prometheus ---------------------------------------
BUCKETS = (25.0, 50.0, 100.0, 200.0, 400.0)


def observations() -> np.ndarray:
    """Spread evenly inside each bucket (so interpolating inside buckets is exact), with 50
    beyond the last finite bound."""
    inside = [
        np.linspace(lo, hi, n, endpoint=False) + (hi - lo) / (2 * n)
        for lo, hi, n in [
            (0, 25, 100),
            (25, 50, 100),
            (50, 100, 150),
            (100, 200, 150),
            (200, 400, 500),
        ]
    ]
    return np.concatenate([*inside, np.full(50, 1000.0)])


@pytest.fixture(scope="module")
def prometheus_with_rollouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus scraping a real prometheus_client histogram of rollout durations
    (the gateway's metric); the observations land after its first scrape, so increase() over
    the window sees all of them."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: run `make setup` (Debian's prometheus package)")
    registry = CollectorRegistry()
    histogram = Histogram(
        PROMETHEUS_METRIC, "whole-rollout durations", buckets=BUCKETS, registry=registry
    )
    port = free_port()
    exporter, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    server = PrometheusServer(Path(binary), tmp_path_factory.mktemp("prometheus"))
    try:
        job = {"job_name": "gateway", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
        server.start([job], rules=[], interval="1s")
        count = f"{PROMETHEUS_METRIC}_count"
        wait_for(lambda: server.query(count), "the first scrape", server)
        for value in observations():
            histogram.observe(float(value))
        total = len(observations())
        wait_for(
            lambda: [r for r in server.query(count) if float(r["value"][1]) == total],
            "a scrape with every observation",
            server,
        )
        time.sleep(2.5)  # a few more samples after the last change
        yield server.url
    finally:
        server.stop()
        exporter.shutdown()
        thread.join(10)


def wait_for(condition, what: str, server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError(f"prometheus: no {what} in 60 s:\n{server.log()}")


def test_durations_from_a_real_prometheus(prometheus_with_rollouts: str) -> None:
    source = histogram_from_prometheus(prometheus_with_rollouts, "5m")
    assert source.upper_bounds_s.tolist() == list(BUCKETS)
    counts = np.diff(np.concatenate([[0.0], source.cumulative]))
    # increase() extrapolates all buckets alike: the shares are the observed ones
    assert counts / counts.sum() == pytest.approx(
        [100 / 1050, 100 / 1050, 150 / 1050, 150 / 1050, 500 / 1050, 50 / 1050], abs=1e-6
    )
    sampled = source.durations(50_000, seed=0)
    observed = observations()
    inside = observed[observed < 400]
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        # below the +Inf bucket the sampled quantiles are the observed ones
        assert np.quantile(sampled, q) == pytest.approx(np.quantile(observed, q), rel=0.03)
    assert np.mean(sampled == 400.0) == pytest.approx(50 / 1050, abs=0.005)
    assert sampled.max() == 400.0 and inside.min() > 0
    assert "+Inf bucket" in source.notes()[0] and "sampled as 400 s" in source.notes()[0]


def test_the_cli_simulates_durations_from_prometheus(prometheus_with_rollouts: str) -> None:
    result = relayrl(
        "--durations-from-prometheus", prometheus_with_rollouts, "--window", "5m", "--steps", "3"
    )
    assert result.returncode == 0, result.stderr
    assert "6-bucket histogram from Prometheus at" in result.stdout
    assert "+Inf bucket" in result.stdout and "rollouts/hour" in result.stdout
