"""The default `relayrl up` really learns: held-out accuracy on arith (greedy, questions the
training never sees) ends at least 15 points above the warm start's, and at 35 % or more,
within the 15 minutes the default run is sized for, warm start included. A full run:
`make test-learning`, not part of `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.core.records import EvalRecord, read_records
from relayrl.up.run_state import RunState
from relayrl_testkit.helpers.up import UpProcess, processes_of

MIN_GAIN_POINTS = 15.0
MIN_FINAL_ACCURACY = 0.35
BUDGET_S = 15 * 60


@pytest.mark.learning
@pytest.mark.timeout(BUDGET_S + 900)
def test_the_default_run_gains_15_points_of_heldout_accuracy(tmp_path: Path) -> None:
    up = UpProcess.start(tmp_path / "runs", {})  # every default, as `make run`
    try:
        assert up.wait(BUDGET_S + 600) == 0, up.output()
        run_dir = up.run_dir
    finally:
        up.stop()
    evals = read_records(run_dir / "eval.jsonl", EvalRecord)
    warm = next(e for e in evals if e.kind == "warm_start")
    final = next(e for e in evals if e.kind == "final")
    assert warm.accuracy is not None and final.accuracy is not None, evals
    gain = (final.accuracy - warm.accuracy) * 100
    print(f"held-out accuracy {warm.accuracy:.1%} -> {final.accuracy:.1%} ({gain:+.1f})")
    assert gain >= MIN_GAIN_POINTS, up.output()
    assert final.accuracy >= MIN_FINAL_ACCURACY, up.output()
    state = RunState.read(run_dir)
    assert state.duration_s is not None and state.duration_s <= BUDGET_S, state
    assert processes_of(run_dir) == []
