"""A held-out evaluation that fails is tried again, and one that fails twice is recorded and
said as failed, never shown as the last good accuracy; an evaluation's deadline follows the
speed the engine was measured at. Pure logic: the evaluator and the stack are stand-ins (the
real evaluation runs in the `relayrl up` tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.core.records import EvalRecord, StepRecord
from relayrl.up import run as up_run
from relayrl.up.config import UpConfig
from relayrl.up.evaluate import DEADLINE_FACTOR, MAX_CONCURRENT, MIN_DEADLINE_S, Evaluator
from relayrl.up.progress import Progress


class Stack:
    engine_url = "http://127.0.0.1:1"
    run_dir = Path("/nonexistent")
    children: dict = {}

    def wait_for_routing(self, timeout_s: float) -> None:
        return None


class FlakyEvaluator:
    """Fails `failures` times, then measures 30 of 40."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def run(self, engine_url: str, kind: str, step: int) -> EvalRecord:
        self.calls += 1
        if self.calls <= self.failures:
            raise TimeoutError("the engine did not answer")
        return EvalRecord(
            kind=kind, step=step, version=step, version_end=step, n=40, correct=30,
            accuracy=0.75, sampled_accuracy=None, seconds=1.0, time=0.0,
        )  # fmt: skip


def a_run(tmp_path: Path, evaluator: FlakyEvaluator, lines: list[str]) -> up_run.Run:
    run = up_run.Run(UpConfig(), tmp_path, say=lines.append)
    run.stack = Stack()  # type: ignore[assignment]
    run.evaluator = evaluator  # type: ignore[assignment]
    return run


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up_run, "EVAL_RETRY_S", 0.0)


def test_a_failed_evaluation_is_tried_again(tmp_path: Path) -> None:
    lines: list[str] = []
    run = a_run(tmp_path, FlakyEvaluator(failures=1), lines)
    record = run._evaluate("periodic", 8)
    assert record is not None and record.accuracy == 0.75
    assert lines[0] == (
        "  held-out evaluation (periodic) failed (TimeoutError: the engine did not answer); "
        "retrying"
    )
    assert [json.loads(x)["accuracy"] for x in run.eval_log.read_text().splitlines()] == [0.75]


def test_an_evaluation_that_fails_twice_is_recorded_and_shown_as_failed(tmp_path: Path) -> None:
    lines: list[str] = []
    run = a_run(tmp_path, FlakyEvaluator(failures=2), lines)
    assert run._evaluate("periodic", 8) is None
    assert lines[-1] == (
        "  held-out evaluation (periodic) FAILED 2 times: TimeoutError: the engine did not answer"
    )
    (record,) = [json.loads(x) for x in run.eval_log.read_text().splitlines()]
    assert record["failed"] is True and record["accuracy"] is None and record["step"] == 8
    progress = Progress(tmp_path, Stack(), 20, lines.append)
    good = EvalRecord(
        kind="periodic", step=4, version=4, version_end=4, n=2, correct=1, accuracy=0.5,
        sampled_accuracy=None, seconds=1.0, time=0.0,
    )  # fmt: skip
    step = StepRecord(step=8, time=0.0)
    line = progress.line(step, None, EvalRecord.model_validate(record))
    assert "held-out FAILED@8" in line and "50.0%" not in line
    assert "held-out 50.0%@4" in progress.line(step, None, good)


def test_the_deadline_follows_the_measured_speed() -> None:
    evaluator = Evaluator.__new__(Evaluator)
    evaluator.max_tokens = 256
    evaluator.tokens_per_s = 100.0  # a real model on one CPU core
    expected = MAX_CONCURRENT * 256 / 100.0
    assert evaluator.deadline_s() == pytest.approx(DEADLINE_FACTOR * expected)  # ~8 min
    evaluator.tokens_per_s = 5000.0  # the tiny model
    assert evaluator.deadline_s() == MIN_DEADLINE_S
