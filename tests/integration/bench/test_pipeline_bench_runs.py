"""`make bench-pipeline`'s harness, small: every real service, the engine emulator and the
simulator run through it and its table and last line come out. The numbers are not checked
(a benchmark is not a timed test); what is checked is that the run is what it claims to be."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
LAST_LINE = re.compile(r"^pipeline-bench: async1/sync=(\d+\.\d\d) fidelity=(\d+\.\d{3})$")

pytestmark = pytest.mark.slow


def test_a_small_pipeline_bench_runs_every_design_against_the_simulator(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(REPO / "bench" / "pipeline_bench.py"),
        "--slots", "8", "--batch-size", "8", "--steps", "3", "--scale", "0.005",
        "--designs", "sync,partial1,drain1", "--keep", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-1]
    rows = {
        line.split("  ")[0].strip(): line for line in lines if re.match(r"^\w+ eta=|^sync ", line)
    }
    assert set(rows) == {"sync", "partial eta=1", "drain eta=1"}, lines
    # Each design really ran: its trainer trained 3 emulated steps on the emulator's rollouts.
    for key in ("sync", "partial1", "drain1"):
        steps = (tmp_path / key / "steps.jsonl").read_text().splitlines()
        assert len(steps) == 3 and all('"emulated_update": 1.0' in s for s in steps)
        served = (tmp_path / key / "engine" / "requests.jsonl").read_text().splitlines()
        assert len(served) >= 3 * 8
    # The drain design switched with pause mode wait; the others kept rollouts in flight.
    for key, mode in (("sync", "keep"), ("partial1", "keep"), ("drain1", "wait")):
        config = (tmp_path / key / "weightsync" / "relayrl-weightsync.yaml").read_text()
        assert f"pause_mode: {mode}" in config


def test_the_bench_refuses_designs_it_cannot_compare() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pipeline_bench.py"), "--designs", "partial2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "--designs needs sync and partial1" in result.stderr
