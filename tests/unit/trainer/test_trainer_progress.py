"""The trainer's progress watch: what a waiting step reports, and the two stop rules (no step
for max(stall_min_s, k x median step), or nearly every recent rollout failed as
infrastructure for longer than the grace period). Pure logic: a fake clock, groups as protos."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq.model import GroupWithTrajectories
from relayrl.trainer.progress import (
    NoProgress,
    ProgressConfig,
    ProgressLog,
    ProgressRecord,
    ProgressWatch,
    failure_reason,
)
from relayrl_testkit.helpers.trainer import judged_group as group


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(clock: Clock, tmp_path: Path | None = None, **settings) -> ProgressWatch:
    log = {"log": tmp_path / "progress.jsonl"} if tmp_path else {}
    return ProgressWatch(ProgressConfig(**settings, **log), clock=clock, wall_clock=clock)


def test_a_waiting_step_reports_what_it_has_every_interval(tmp_path: Path) -> None:
    clock = Clock()
    w = watch(clock, tmp_path, report_interval_s=30)
    w.observe(group([1.0, 0.0]), "keep")
    w.observe(group([0.0, 0.0, 0.0]), "no_signal")
    w.observe(group([0.0, None]), "one_valid")
    w.observe(group([None, None]), "no_valid")
    clock.now = 10
    w.waiting(step=4, wanted=16, kept=1, consumed=4)  # before the interval: nothing
    clock.now = 31
    w.waiting(step=4, wanted=16, kept=1, consumed=4)
    (record,) = ProgressLog(tmp_path / "progress.jsonl").read_all()
    assert record.kind == "waiting"
    assert (record.step, record.kept, record.wanted, record.consumed) == (4, 1, 16, 4)
    assert record.rejected == {"no_signal": 1, "one_valid": 1, "no_valid": 1}
    assert record.no_signal == {"all scored 0": 1}
    assert (record.rollouts, record.failed_rollouts, record.top_failure_count) == (9, 3, 3)
    assert record.line() == (
        "step 4 waiting 31s: 1 of 16 groups kept; rejected no_signal 1 (all scored 0 1), "
        "no_valid 1, one_valid 1; 3 of 9 rollouts failed (most common, 3x: agent exited 1: boom)"
    )
    clock.now = 45
    w.waiting(step=4, wanted=16, kept=1, consumed=4)  # 14 s after the last report
    assert len(ProgressLog(tmp_path / "progress.jsonl").read_all()) == 1


def test_no_step_for_the_stall_limit_ends_the_run_with_the_cause(tmp_path: Path) -> None:
    clock = Clock()
    w = watch(clock, tmp_path, stall_min_s=600, report_interval_s=30)
    for _ in range(40):
        w.observe(group([0.0] * 8), "no_signal")
    clock.now = 599
    w.waiting(step=0, wanted=8, kept=0, consumed=40)
    clock.now = 600
    with pytest.raises(NoProgress) as raised:
        w.waiting(step=0, wanted=8, kept=0, consumed=40)
    cause = str(raised.value)
    assert cause.startswith("no step completed in 10m00s (the limit is 10m00s): step 0 has 0 of 8")
    assert "the filter rejected 40 of 40 groups as without signal (all scored 0 40)" in cause
    stopped = ProgressLog(tmp_path / "progress.jsonl").read_all()[-1]
    assert (stopped.kind, stopped.cause) == ("stopped", cause)
    assert stopped.line() == f"no progress: {cause}"


def test_the_stall_limit_follows_the_median_step() -> None:
    clock = Clock()
    w = watch(clock, stall_min_s=600, stall_step_factor=5)
    for duration in (100.0, 300.0, 200.0):  # median 200 s: limit 1000 s
        clock.now += duration
        w.step_completed()
    assert w.stall_limit_s() == 1000
    clock.now += 999
    w.waiting(step=3, wanted=1, kept=0, consumed=0)
    clock.now += 1
    with pytest.raises(NoProgress, match=r"no scored group arrived: is rollout .* running"):
        w.waiting(step=3, wanted=1, kept=0, consumed=0)


def test_rollouts_failing_as_infrastructure_end_the_run_after_the_grace() -> None:
    clock = Clock()
    w = watch(clock, infra_window=200, infra_fraction=0.95, infra_grace_s=120)
    for _ in range(24):  # 192 rollouts: below the window
        w.observe(
            group([None] * 8, error="agent 'external' exited 1: ImportError\nmore"), "no_valid"
        )
    w.waiting(step=0, wanted=4, kept=0, consumed=24)
    w.observe(group([None] * 7 + [1.0]), "one_valid")  # 200 rollouts, 199 failed
    w.waiting(step=0, wanted=4, kept=0, consumed=25)  # not yet: within the grace
    clock.now = 121
    with pytest.raises(NoProgress) as raised:
        w.waiting(step=0, wanted=4, kept=0, consumed=25)
    assert str(raised.value) == (
        "199 of the last 200 rollouts failed as infrastructure (the limit is 95%); most common, "
        "192x: agent 'external' exited 1: ImportError"
    )


def test_a_fault_that_heals_does_not_trip_the_infrastructure_rule() -> None:
    clock = Clock()
    w = watch(clock, infra_window=200, infra_fraction=0.95, infra_grace_s=120)
    for _ in range(20):  # an engine restart: 160 rollouts fail
        w.observe(group([None] * 8), "no_valid")
    clock.now = 30
    for _ in range(30):  # then it serves again
        w.observe(group([1.0, 0.0] * 4), "keep")
    clock.now = 500
    w.waiting(step=9, wanted=16, kept=15, consumed=50)  # no NoProgress: 40 of 200 failed


def test_failure_reasons_name_rollouts_and_scorers() -> None:
    ok, failed = group([1.0, None]).trajectories
    assert failure_reason(ok) is None
    assert failure_reason(failed) == "agent exited 1: boom"
    timeout = common_pb2.Trajectory(uid="g", index=0)
    timeout.tags.status = common_pb2.TRAJECTORY_STATUS_SCORED
    timeout.reward.status = common_pb2.REWARD_STATUS_TIMEOUT
    timeout.reward.message = "judge did not answer in 30 s"
    assert failure_reason(timeout) == "reward TIMEOUT: judge did not answer in 30 s"


def test_the_progress_log_skips_a_line_cut_by_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    record = ProgressRecord(kind="waiting", step=1, waited_s=30, wanted=4)
    path.write_text(record.to_json() + "\n" + '{"kind": "wait')
    log = ProgressLog(path)
    assert log.new_records() == [record]
    with path.open("a") as f:
        f.write('ing"}\nnot json\n')
    assert log.new_records() == []  # the cut record, completed, is still not a record


@pytest.mark.parametrize(
    ("rewards", "dapo_filter", "verdict"),
    [
        ([1.0, 0.0], True, "keep"),
        ([1.0, 1.0], True, "no_signal"),
        ([1.0, 1.0], False, "keep"),
        ([1.0, None], False, "one_valid"),  # one valid member of two: nothing to compare
        ([None, None], False, "no_valid"),
        ([1.0], False, "keep"),  # issued with one sample (make bench-pipeline)
        ([1.0], True, "no_signal"),
        ([None], False, "no_valid"),
    ],
)
def test_the_leaders_verdict_on_a_group(
    rewards: list[float | None], dapo_filter: bool, verdict: str
) -> None:
    from types import SimpleNamespace

    from relayrl.trainer.loop import Leader

    leader = SimpleNamespace(
        feeder=None, config=SimpleNamespace(algorithm=SimpleNamespace(dapo_filter=dapo_filter))
    )
    assert Leader.judge(leader, group(rewards), step=0) == verdict  # type: ignore[arg-type]


def test_a_kept_group_with_equal_rewards_counts_its_tokens_as_without_signal() -> None:
    """With the filter off such a group is trained, with no advantage: the summary's wasted
    share must not call its tokens useful."""
    w = watch(Clock())

    def tokens(rewards: list[float | None], count: int) -> GroupWithTrajectories:
        made = group(rewards)
        for trajectory in made.trajectories:
            trajectory.response_token_ids.extend([5] * count)
        return made

    w.observe(tokens([1.0, 0.0], 10), "keep")
    w.observe(tokens([0.0, 0.0], 7), "keep")  # kept with the filter off
    w.observe(tokens([1.0, 1.0], 3), "no_signal")
    assert w.step_tally().tokens == {"keep": 20, "no_signal": 20}
    assert w.step_tally().no_signal == {"all scored 1": 1}  # only what the filter rejected
