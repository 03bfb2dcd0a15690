"""A held-out evaluation that fails is tried again, and one that fails twice is recorded and
said as failed, never shown as the last good accuracy; an evaluation's deadline follows the
speed the engine was measured at. Pure logic: the evaluator and the supervisor are stand-ins (the
real evaluation runs in the `relayrl up` tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.core.records import EvalRecord, StepRecord, append_record
from relayrl.up import progress as up_progress
from relayrl.up import run as up_run
from relayrl.up.config import UpConfig
from relayrl.up.evaluate import (
    DEADLINE_FACTOR,
    MAX_CONCURRENT,
    MIN_DEADLINE_S,
    Answer,
    Evaluator,
    served_range,
)
from relayrl.up.progress import Progress
from relayrl.up.status import _eval_lines as status_lines_of_evals


class FakeSupervisor:
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
    run.supervisor = FakeSupervisor()  # type: ignore[assignment]
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
    assert run._evaluated("periodic") and not run._evaluated("final")  # a resume skips it


def test_an_evaluation_that_fails_twice_is_recorded_and_shown_as_failed(tmp_path: Path) -> None:
    lines: list[str] = []
    run = a_run(tmp_path, FlakyEvaluator(failures=2), lines)
    assert run._evaluate("periodic", 8) is None
    assert lines[-1] == (
        "  held-out evaluation (periodic) FAILED 2 times: TimeoutError: the engine did not answer"
    )
    (record,) = [json.loads(x) for x in run.eval_log.read_text().splitlines()]
    assert record["failed"] is True and record["accuracy"] is None and record["step"] == 8
    assert not run._evaluated("periodic")  # a failed one is tried again after a resume
    progress = Progress(tmp_path, FakeSupervisor(), 20, lines.append)
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


def test_progress_says_each_logged_step_once_and_status_says_a_failed_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(up_progress, "replica_versions", lambda target, run_dir: None)

    class Targets(FakeSupervisor):
        def target(self, name: str) -> str:
            return "127.0.0.1:1"

    steps = tmp_path / "trainer" / "steps.jsonl"
    lines: list[str] = []
    progress = Progress(tmp_path, Targets(), 4, lines.append)
    assert progress.poll() == 0 and lines == []
    good = EvalRecord(
        kind="periodic", step=1, version=1, version_end=1, n=2, correct=1, accuracy=0.5,
        sampled_accuracy=None, seconds=1.0, time=0.0,
    )  # fmt: skip
    append_record(tmp_path / "eval.jsonl", good)
    step_1 = StepRecord(step=1, time=0.0, reward_mean=0.25).to_line()
    append_record(steps, StepRecord(step=0, time=0.0, reward_mean=0.5))
    with steps.open("a") as f:
        f.write(step_1[:10])  # still being written
    assert progress.poll() == 1
    assert lines[0].startswith("step 1/4  reward 0.50  held-out 50.0%@1  weight-sync ?")
    with steps.open("a") as f:
        f.write(step_1[10:] + "\n")
    append_record(tmp_path / "eval.jsonl", EvalRecord.failure("periodic", 2, "TimeoutError", 1.0))
    assert progress.poll() == 2 and len(lines) == 2
    assert lines[1].startswith("step 2/4  reward 0.25  held-out FAILED@2  weight-sync ?")
    assert status_lines_of_evals(tmp_path) == [
        "held-out: 50.0%@1, FAILED@2 (greedy accuracy at trainer step)"
    ]


def answer(versions: list[int]) -> Answer:
    return Answer(
        index=0, data_source="arith", ground_truth="4", response="4", correct=True,
        tokens=len(versions), versions=versions,
    )  # fmt: skip


def test_an_evaluation_names_the_versions_that_served_its_tokens_not_the_loading_label() -> None:
    # It started while version 3 loaded (the label said loading-3, read as -1), was paused,
    # and every token came from version 3 once it was committed; one answer straddled 3 -> 4.
    answers = [answer([3]), answer([3, 4]), answer([])]
    assert served_range(answers, label_start=-1, label_end=-1) == (3, 4)
    # No token generated at all: the labels are all there is.
    assert served_range([answer([])], label_start=2, label_end=2) == (2, 2)
    # Tokens that no version served stay visible to the audit.
    assert served_range([answer([-1, 5])], label_start=5, label_end=5) == (-1, 5)
