"""A group that cannot be trained for a reason outside the policy (no valid member, one valid
member of several, too stale) has its prompt re-issued as a new group that names it, within a
budget per issue; past it the prompt is skipped with its cause, or the run ends
(docs/algorithms.md#retries). The leader's side, over a real feeder and curriculum and a queue
that only records what is put."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.trainer.curriculum import Curriculum, CurriculumConfig, RetryConfig
from relayrl.trainer.feeder import GroupTemplate, PromptFeeder, PromptRecord
from relayrl.trainer.loop import Leader
from relayrl.trainer.progress import NoProgress, ProgressConfig, ProgressWatch
from relayrl.trainer.replay import Sample
from relayrl_testkit.helpers.trainer import judged_group


class PutRecorder:
    """What issuing and adopting ask of the queue: the groups put, by uid."""

    def __init__(self) -> None:
        self.groups: dict[str, common_pb2.PromptGroup] = {}

    def put_groups(self, partition: str, groups: list[common_pb2.PromptGroup]) -> None:
        for group in groups:
            group.tags.prompt_step = group.prompt_step  # as the queue reads it back
            self.groups[group.uid] = group

    def groups_exist(self, partition: str, uids: list[str]) -> list[bool]:
        return [uid in self.groups for uid in uids]

    def get_groups(self, partition: str, uids: list[str], **_: object) -> list[SimpleNamespace]:
        return [SimpleNamespace(group=self.groups[uid]) for uid in uids]

    def reset_consumption(self, partition: str, after_step: int) -> list[str]:
        return []


def leader(
    budget: int = 3,
    on_exhausted: str = "skip",
    threshold: int = 2,
    queue: PutRecorder | None = None,
) -> Leader:
    records = [PromptRecord((("user", f"{i}+1="),), str(i + 1), "arith", "", ()) for i in range(6)]
    curriculum = Curriculum(
        len(records),
        0,
        CurriculumConfig(replay_share=0.0),
        RetryConfig(budget=budget, on_exhausted=on_exhausted),
    )
    template = GroupTemplate("train", "run", 2, 16, 1.0, "")
    queue = queue or PutRecorder()
    feeder = PromptFeeder(queue, records, template, curriculum)  # type: ignore[arg-type]
    config = SimpleNamespace(
        data=SimpleNamespace(partition="train", retry=curriculum.retry_settings),
        algorithm=SimpleNamespace(dapo_filter=True),
        staleness_threshold=threshold,
        outage_timeout_s=1.0,
    )
    return Leader(
        config,  # type: ignore[arg-type]
        queue,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        feeder=feeder,
        sampler=None,  # type: ignore[arg-type]
        watch=ProgressWatch(ProgressConfig()),
        gateway=None,
    )


def issue(lead: Leader, step: int = 0) -> common_pb2.PromptGroup:
    """The next group the feeder puts."""
    feeder = lead.feeder
    assert feeder is not None
    feeder.issue_up_to(feeder.num_issued + 1, step)
    return lead.tq.groups[feeder.uid(feeder.num_issued - 1)]  # type: ignore[attr-defined]


def consumed(group: common_pb2.PromptGroup, rewards: list[float | None]):
    judged = judged_group(rewards, prompt_step=group.prompt_step)
    judged.group.CopyFrom(group)
    return judged


@pytest.mark.parametrize(
    ("rewards", "verdict", "reissued"),
    [
        ([None, None], "no_valid", True),  # every member failed as infrastructure
        ([1.0, None], "one_valid", True),  # the other failed: nothing to compare
        ([1.0, 1.0], "no_signal", False),  # the policy's own outcome: equal rewards
        ([1.0, 0.0], "keep", False),
    ],
)
def test_a_group_failed_outside_the_policy_is_reissued_with_its_prompt(
    rewards: list[float | None], verdict: str, reissued: bool
) -> None:
    lead = leader()
    first = issue(lead)
    assert lead.judge(consumed(first, rewards), step=0) == verdict
    nxt = issue(lead, step=1)
    if reissued:
        assert (nxt.prompt_key, nxt.retry_of, nxt.retry) == (first.prompt_key, first.uid, 1)
        assert nxt.uid != first.uid and nxt.prompt_step == 1
    else:
        assert (nxt.retry_of, nxt.retry) == ("", 0)
    metrics = lead._sample_metrics(0, Sample(kept=[]))
    assert metrics.retried == ({verdict: 1} if reissued else {})


def test_groups_the_staleness_gate_drops_are_reissued_and_skipped_with_their_staleness() -> None:
    lead = leader(budget=1, threshold=2)
    first = issue(lead, step=0)
    lead._discard([first], step=3)  # evicted: staleness 4 > 2
    retry = issue(lead, step=3)
    assert (retry.retry_of, retry.retry) == (first.uid, 1)
    lead._discard([retry], step=6)
    metrics = lead._sample_metrics(6, Sample(kept=[]))
    assert metrics.retried == {"stale": 1}
    assert metrics.skipped == [
        {
            "prompt": int(first.prompt_key),
            "uid": retry.uid,
            "retries": 1,
            "cause": "stale",
            "reason": "staleness 4 > 2 at step 6",
        }
    ]
    assert issue(lead, step=6).retry_of == ""  # the walk goes on


def test_with_on_exhausted_stop_the_run_ends_with_one_line_naming_the_prompt() -> None:
    lead = leader(budget=0, on_exhausted="stop")
    first = issue(lead)
    with pytest.raises(NoProgress) as stopped:
        lead.judge(consumed(first, [None, None]), step=2)
    assert str(stopped.value) == (
        f"prompt {first.prompt_key} could not be trained after 0 re-issues (its last group "
        f"{first.uid}: no_valid, 2 of 2 rollouts failed (most common, 2x: agent exited 1: "
        "boom)); data.retry.on_exhausted is stop"
    )


def test_a_verdict_heard_again_after_a_stop_in_mid_step_reissues_nothing() -> None:
    lead = leader()
    first = issue(lead)
    lead.judge(consumed(first, [None, None]), step=0)
    lead.judge(consumed(first, [None, None]), step=0)  # the step re-runs after a restart
    assert lead._sample_metrics(0, Sample(kept=[])).retried == {"no_valid": 1}
    assert issue(lead).retry_of == first.uid
    assert issue(lead).retry_of == ""


def test_a_group_reissued_before_a_restart_is_not_trained_when_it_is_fresh_again() -> None:
    lead = leader()
    assert lead.feeder is not None
    stale = issue(lead, step=0)
    saved = lead.feeder.state_dict()  # the checkpoint: `stale` is in flight
    lead._discard([stale], step=4)  # consumed as too stale; re-issued; then a crash
    retry = issue(lead, step=4)
    restored = leader(queue=lead.tq)  # type: ignore[arg-type]
    assert restored.feeder is not None
    restored.feeder.load_state_dict(saved)
    assert restored.feeder.adopt_existing() == 1  # the re-issue, read back from the queue
    # judged again at an earlier step, where it is fresh and has a signal: not trained
    assert restored.judge(consumed(stale, [1.0, 0.0]), step=1) == "stale"
    assert restored._sample_metrics(1, Sample(kept=[])).retried == {"stale": 1}
    assert issue(restored, step=1).retry_of == ""  # and not re-issued a second time
    assert retry.uid in lead.tq.groups  # type: ignore[attr-defined]


def test_a_resumed_leader_reissues_a_group_evicted_after_its_checkpoint() -> None:
    """The gate drops a group before the feeder hears of it: a trainer that died in between
    leaves it in flight in its checkpoint and dropped in the queue."""
    lead = leader()
    assert lead.feeder is not None
    evicted = issue(lead, step=0)
    saved = lead.feeder.state_dict()
    evicted.tags.status = common_pb2.GROUP_STATUS_DROPPED  # then the crash
    restored = leader(queue=lead.tq)  # type: ignore[arg-type]
    restored.resume(1, saved, refill_groups=2)
    assert restored.refill_groups == 3  # the eviction's refill credit, lost with the process
    retry = issue(restored, step=1)
    assert (retry.retry_of, retry.prompt_key) == (evicted.uid, evicted.prompt_key)
    assert restored._sample_metrics(1, Sample(kept=[])).retried == {"stale": 1}
