"""`relayrl audit` calls a consumed group lost only when the trainer would have trained it: its
rules are the trainer's own verdict (`judge_group`) plus the staleness bound; a held-out
evaluation is stale when its version was not the committed one while it ran. Pure logic: groups
as protos, records written by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.core.records import EvalRecord, TransferRecord, append_record
from relayrl.trainer.replay import judge_group
from relayrl.up.audit import AuditReport, CommitTimeline, StepRules, _check_evaluations
from relayrl_testkit.helpers.trainer import judged_group as group


@pytest.mark.parametrize(
    ("rewards", "dapo", "verdict"),
    [
        ([1.0, 0.0, 1.0, 0.0], True, "keep"),
        ([1.0, 1.0, 1.0, 1.0], True, "no_signal"),
        ([1.0, 1.0, 1.0, 1.0], False, "keep"),
        # one valid member of four: nothing to compare, with the filter on or off
        ([1.0, None, None, None], False, "one_valid"),
        ([1.0, None, None, None], True, "one_valid"),
        ([None, None, None, None], False, "no_valid"),
        ([1.0], False, "keep"),
        ([1.0, None, 0.0, None], True, "keep"),
    ],
)
def test_the_audit_rejects_exactly_what_the_trainer_does_not_keep(
    rewards: list[float | None], dapo: bool, verdict: str
) -> None:
    g = group(rewards)
    assert judge_group(g, use_dapo_filter=dapo) == verdict
    rules = StepRules(staleness_threshold=1, dapo_filter=dapo)
    assert rules.rejected(g, step=0) is (verdict != "keep")


def test_a_group_past_the_staleness_bound_is_rejected_whatever_its_rewards() -> None:
    rules = StepRules(staleness_threshold=2, dapo_filter=False)
    assert not rules.rejected(group([1.0, 0.0], prompt_step=3), step=4)
    assert rules.rejected(group([1.0, 0.0], prompt_step=2), step=4)


def test_an_evaluation_on_a_version_not_committed_while_it_ran_is_stale(tmp_path: Path) -> None:
    """Read from the run's transfers.jsonl and eval.jsonl; a failed evaluation ran on nothing."""
    for version, at, state in (
        (1, 100.0, "committed"),
        (2, 200.0, "failed"),
        (3, 300.0, "committed"),
    ):
        append_record(
            tmp_path / "weightsync" / "transfers.jsonl",
            TransferRecord(
                version=version, trainer_step=version, state=state, transport="grpc", bytes=1,
                replicas=["engine-0"], durations_s={"transport": 0.1}, error="", time=at,
            ),
        )  # fmt: skip
    for step, version, end in ((1, 1, 150.0), (2, 2, 250.0)):
        append_record(
            tmp_path / "eval.jsonl",
            EvalRecord(
                kind="periodic", step=step, version=version, version_end=1, n=4, correct=2,
                accuracy=0.5, sampled_accuracy=None, seconds=10.0, time=end,
            ),
        )  # fmt: skip
    append_record(tmp_path / "eval.jsonl", EvalRecord.failure("final", 3, "TimeoutError", 1.0))

    report = AuditReport()
    _check_evaluations(tmp_path, CommitTimeline.of_run(tmp_path), report)

    assert report.stale_served == [
        "held-out evaluation (periodic, step 2) on version 2, committed meanwhile: [1]"
    ]


def test_only_the_drop_policy_judges_a_group_stale() -> None:
    """Under `wait` the trainer never rejects for staleness: a group it did not train was
    judged by `judge_group` alone, and a policy outcome needs no re-issue."""
    old_flat = group([1.0, 1.0], prompt_step=0)
    assert StepRules(staleness_threshold=1).verdict(old_flat, step=4) == "stale"
    waiting = StepRules(staleness_threshold=1, staleness_policy="wait")
    assert waiting.verdict(old_flat, step=4) == "no_signal"
