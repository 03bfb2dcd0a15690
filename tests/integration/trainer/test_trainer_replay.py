"""The trainer's side of the TransferQueue against a real redis-server: the staleness gate
(drop: staleness > threshold evicted; wait: blocked while in flight >= threshold), DAPO
verdicts and refill credit, idempotent consumption per step, and the prompt feeder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.tq import TransferQueue
from relayrl.tq.model import GroupStatus
from relayrl.tq.queue import TQUnavailableError
from relayrl.tq.server import RedisServer
from relayrl.trainer.curriculum import Curriculum, CurriculumConfig
from relayrl.trainer.feeder import GroupTemplate, PromptFeeder, PromptFileError, load_prompts
from relayrl.trainer.progress import NoProgress, ProgressConfig, ProgressWatch
from relayrl.trainer.replay import ReplaySampler
from relayrl_testkit.helpers.trainer import claim, put_group, scored_group


def keep_all(group) -> str:
    return "keep"


def watch(stall_s: float = 30.0) -> ProgressWatch:
    clock = iter(range(1_000_000))  # a fake clock: every reading is one second later
    settings = ProgressConfig(stall_min_s=stall_s, report_interval_s=5)
    return ProgressWatch(settings, clock=lambda: float(next(clock)))


def sampler(tq: TransferQueue, policy: str = "drop", threshold: int = 2, **kw) -> ReplaySampler:
    return ReplaySampler(
        tq,
        "train",
        policy=policy,
        threshold=threshold,
        poll_interval_s=0.0,
        watch=watch(kw.pop("stall_s", 30.0)),
        refill_per_filtered=kw.pop("refill_per_filtered", 1),
        filter_budget=kw.pop("filter_budget", None),
        sleep=lambda s: None,
    )


def status_of(tq: TransferQueue, uid: str) -> int:
    return tq.get_groups("train", [uid], with_trajectories=False)[0].group.tags.status


def test_drop_evicts_strictly_above_the_threshold(tq: TransferQueue) -> None:
    # at step 3 with threshold 2: prompt_step 1 -> staleness 3 (> 2, dropped);
    # prompt_step 2 -> staleness 2 (kept: drop uses >, not >=)
    scored_group(tq, "old", [1.0, 0.0], prompt_step=1)
    scored_group(tq, "edge", [1.0, 0.0], prompt_step=2)
    refills: list[int] = []
    sample = sampler(tq, "drop", 2).sample(3, 1, keep_all, refills.append)
    assert [g.group.uid for g in sample.kept] == ["edge"]
    assert sample.num_evicted == 1 and refills == [1]
    from relayrl.proto.common.v1 import common_pb2

    assert status_of(tq, "old") == common_pb2.GROUP_STATUS_DROPPED
    assert status_of(tq, "edge") == common_pb2.GROUP_STATUS_CONSUMED


def test_staleness_is_step_minus_prompt_step_plus_one(tq: TransferQueue) -> None:
    s = sampler(tq)
    assert s.staleness(prompt_step=5, step=5) == 1  # issued and trained at one step
    assert s.staleness(prompt_step=3, step=5) == 3


def test_wait_blocks_while_an_inflight_group_reaches_the_threshold(tq: TransferQueue) -> None:
    scored_group(tq, "ready", [1.0, 0.0], prompt_step=2)
    put_group(tq, "slow", n=2, prompt_step=1)  # pending; at step 2, threshold 2: staleness 2
    s = sampler(tq, "wait", 2, stall_s=5)
    assert s.blocked(2)  # >= threshold: blocks (wait uses >=, not >)
    assert not s.blocked(1)  # staleness 1 < 2
    with pytest.raises(NoProgress, match=r"no step completed .* 0 of 1 groups"):
        s.sample(2, 1, keep_all, lambda n: None)
    # nothing was consumed or dropped while blocked
    from relayrl.proto.common.v1 import common_pb2

    assert status_of(tq, "ready") == common_pb2.GROUP_STATUS_SCORED
    assert status_of(tq, "slow") == common_pb2.GROUP_STATUS_PENDING


def test_wait_takes_the_group_once_it_finished(tq: TransferQueue) -> None:
    scored_group(tq, "late", [1.0, 0.0], prompt_step=0)
    # staleness 3 at step 2: under `wait` nothing is evicted, the old group is trained
    sample = sampler(tq, "wait", 2).sample(2, 1, keep_all, lambda n: None)
    assert [g.group.uid for g in sample.kept] == ["late"]


def test_running_groups_are_never_evicted(tq: TransferQueue) -> None:
    put_group(tq, "inflight", n=2, prompt_step=0)
    claim(tq, "inflight")
    assert sampler(tq, "drop", 1).evict_stale(5) == []  # nothing finished or scored
    assert tq.counts("train").groups[GroupStatus.RUNNING] == 1


def test_dapo_verdicts_and_refill_credit(tq: TransferQueue) -> None:
    from relayrl.trainer.advantages import GroupRewards, dapo_filter

    # zero std: no signal -> credit 2 (DAPO's rule, docs/algorithms.md#refill-credit)
    scored_group(tq, "flat", [1.0, 1.0])
    scored_group(tq, "allinfra", [None, None])  # no valid member -> credit 1
    scored_group(tq, "good", [1.0, 0.0])

    def judge(group) -> str:
        rewards = GroupRewards(
            group.group.uid,
            [t.reward.score for t in group.trajectories],
            [t.tags.is_infra for t in group.trajectories],
        )
        result = dapo_filter([rewards])
        return "keep" if result.kept else ("no_valid" if result.failed else "no_signal")

    refills: list[int] = []
    sample = sampler(tq, refill_per_filtered=2).sample(0, 1, judge, refills.append)
    assert [g.group.uid for g in sample.kept] == ["good"]
    assert dict(sample.rejected) == {"no_signal": 1, "no_valid": 1}
    assert sorted(refills) == [1, 2] and sample.num_consumed == 3


def test_a_retried_step_gets_the_same_groups(tq: TransferQueue) -> None:
    for i in range(4):
        scored_group(tq, f"g{i}", [1.0, 0.0])
    first = sampler(tq).sample(0, 2, keep_all, lambda n: None)
    again = sampler(tq).sample(0, 2, keep_all, lambda n: None)
    assert [g.group.uid for g in again.kept] == [g.group.uid for g in first.kept]
    # after a restore to before step 0, the groups are scored again and can be retaken
    assert sorted(tq.reset_consumption("train", after_step=0)) == []
    nxt = sampler(tq).sample(1, 2, keep_all, lambda n: None)
    assert {g.group.uid for g in nxt.kept}.isdisjoint(g.group.uid for g in first.kept)


def test_waiting_for_data_ends_with_a_clear_error(tq: TransferQueue) -> None:
    with pytest.raises(NoProgress, match=r"no scored group arrived: is rollout .* running"):
        sampler(tq, stall_s=3).sample(0, 1, keep_all, lambda n: None)


# -- the prompt feeder -----------------------------------------------------------------------


def prompts_file(tmp_path: Path, n: int = 5) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "arith"})
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def feeder(tq: TransferQueue, tmp_path: Path, **settings) -> PromptFeeder:
    template = GroupTemplate("train", "run1", 2, 16, 1.0, "")
    records = load_prompts(prompts_file(tmp_path))
    curriculum = Curriculum(len(records), 7, CurriculumConfig(**settings))
    return PromptFeeder(tq, records, template, curriculum)


def truths(tq: TransferQueue, f: PromptFeeder, ns: range) -> list[str]:
    groups = tq.get_groups("train", [f.uid(n) for n in ns], with_trajectories=False)
    return [g.group.ground_truth for g in groups]


def test_feeder_issues_in_a_seeded_order_and_covers_every_prompt(tq, tmp_path) -> None:
    f = feeder(tq, tmp_path)
    assert f.issue_up_to(5, step=0) == 5
    issued = truths(tq, f, range(5))
    assert sorted(int(t) for t in issued) == [1, 2, 3, 4, 5]  # one epoch = every prompt once
    assert f.issue_up_to(5, step=0) == 0  # already there: nothing new
    groups = tq.get_groups("train", [f.uid(n) for n in range(5)], with_trajectories=False)
    assert [f.prompt_index(g.group) for g in groups] == [int(t) - 1 for t in issued]
    other = feeder(tq, tmp_path)  # the same seed chooses the same prompts
    chosen = [other.curriculum.next_issue(0, other.uid(n)).index for n in range(5)]
    assert chosen == [int(t) - 1 for t in issued]


def test_feeder_resume_adopts_groups_issued_after_the_checkpoint(tq, tmp_path) -> None:
    f = feeder(tq, tmp_path)
    f.issue_up_to(1, step=0)
    saved = json.loads(json.dumps(f.state_dict()))  # the checkpoint saw only one
    f.issue_up_to(3, step=0)
    resumed = feeder(tq, tmp_path)
    resumed.load_state_dict(saved)
    assert resumed.adopt_existing() == 2
    assert resumed.issue_up_to(5, step=1) == 2  # the two prompts of the epoch left
    assert sorted(int(t) for t in truths(tq, resumed, range(5))) == [1, 2, 3, 4, 5]
    assert tq.counts("train").groups[GroupStatus.PENDING] == 5


def test_feeder_replays_a_prompt_with_signal_and_a_failed_put_keeps_its_choice(
    tq: TransferQueue, tmp_path: Path, redis_server: RedisServer
) -> None:
    f = feeder(tq, tmp_path, replay_share=0.5)
    f.issue_up_to(2, step=0)
    first, second = tq.get_groups("train", [f.uid(0), f.uid(1)], with_trajectories=False)
    f.observe(first.group, 0, [1.0, 0.0])  # signal: replayed next
    f.observe(second.group, 0, [0.0, 0.0])
    # a clean stop: a SIGKILL can lose the last second of an `everysec` AOF, and with it the
    # groups just put; what is tested here is the feeder's choice across a failed put
    redis_server.stop()
    with pytest.raises(TQUnavailableError):
        f.issue_up_to(3, step=1)  # the prompt is chosen, the put fails
    redis_server.start()
    f.issue_up_to(3, step=1)  # the retry puts the prompt chosen before, not the next one
    assert truths(tq, f, range(3))[2] == first.group.ground_truth
    assert f.curriculum.state_dict()["num_replays"] == 1


def test_a_resumed_feeder_reissues_a_group_evicted_after_its_checkpoint(tq, tmp_path) -> None:
    """The gate drops a group before the feeder hears of it; a trainer that died between the
    two leaves a group in flight in its checkpoint that the queue holds as dropped. Another,
    re-issued before the crash, is adopted with its link, and re-issued nothing more."""
    from relayrl.trainer.replay import ReplaySampler

    f = feeder(tq, tmp_path)
    f.issue_up_to(2, step=0)
    saved = json.loads(json.dumps(f.state_dict()))  # both groups in flight
    evicted, failed = f.uid(0), f.uid(1)
    for uid in (evicted, failed):
        claimed = claim(tq, uid)
        tq.put_trajectories("train", [_failed(uid, i, claimed) for i in range(2)])
    (group,) = tq.get_groups("train", [failed], with_trajectories=False)
    assert f.retry(group.group, "no_valid", "2 of 2 rollouts failed") is None
    f.issue_up_to(3, step=1)  # its re-issue is put
    (retry,) = tq.get_groups("train", [f.uid(2)], with_trajectories=False)
    assert (retry.group.retry_of, retry.group.retry) == (failed, 1)
    assert retry.group.prompt_key == group.group.prompt_key
    sampler = ReplaySampler(tq, "train", policy="drop", threshold=1, poll_interval_s=0.01,
                            watch=watch())  # fmt: skip
    assert {g.uid for g in sampler.evict_stale(5)} == {evicted, failed}  # then a crash

    resumed = feeder(tq, tmp_path)
    resumed.load_state_dict(saved)
    assert resumed.adopt_existing() == 1
    dropped = resumed.dropped_in_flight()
    assert sorted(g.uid for g in dropped) == sorted([evicted, failed])
    for g in dropped:  # what Leader.resume does with them
        assert resumed.retry(g, "stale", "evicted before a restart") is None
    resumed.issue_up_to(5, step=5)
    again = tq.get_groups("train", [resumed.uid(3), resumed.uid(4)], with_trajectories=False)
    assert [g.group.retry_of for g in again] == [evicted, ""]  # `failed` once only


def _failed(uid: str, index: int, claim_id: str):
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.tq import TrajectoryPut

    trajectory = common_pb2.Trajectory(uid=uid, index=index, error="engine died")
    return TrajectoryPut(trajectory, claim_id, failed=True)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", ":1: not JSON"),
        ('{"prompt": "x", "messages": []}', "exactly one of"),
        ('{"prompt": ""}', "non-empty"),
        ('{"prompt": "x", "answer": "1"}', "unknown keys"),
        ('{"messages": [{"role": "user"}]}', "role` and `content"),
    ],
)
def test_bad_prompt_files_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(PromptFileError, match=match):
        load_prompts(path)


def test_a_trainer_without_a_checkpoint_gives_back_every_consumed_group(
    tq: TransferQueue,
) -> None:
    for uid in ("a", "b", "c"):
        scored_group(tq, uid, [1.0, 0.0])
    assert sorted(tq.consume("train", 0, 2) + tq.consume("train", 1, 1)) == ["a", "b", "c"]
    assert sorted(tq.reset_consumption("train", after_step=-1)) == ["a", "b", "c"]
    assert tq.counts("train").groups[GroupStatus.SCORED] == 3
    with pytest.raises(Exception, match="after_step must be an integer >= -1"):
        tq.reset_consumption("train", after_step=-2)


def test_sampling_waits_out_a_redis_restart(tq: TransferQueue, redis_server: RedisServer) -> None:
    scored_group(tq, "survivor", [1.0, 0.0])
    redis_server.kill()  # as SIGKILL: the group is in the AOF
    restarted: list[float] = []

    def sleep(seconds: float) -> None:  # the sampler's backoff: Redis comes back meanwhile
        if not restarted:
            redis_server.start()
        restarted.append(seconds)

    sampler = ReplaySampler(
        tq, "train", policy="drop", threshold=2, poll_interval_s=0.0, watch=watch(), sleep=sleep,
    )  # fmt: skip
    sample = sampler.sample(0, 1, keep_all, lambda n: None)
    assert [g.group.uid for g in sample.kept] == ["survivor"]
    assert restarted == [0.5]  # one backoff, then it answered


def no_signal_unless_mixed(group) -> str:
    rewards = {t.reward.score for t in group.trajectories}
    return "keep" if len(rewards) > 1 else "no_signal"


def test_a_spent_filter_budget_trains_on_what_it_kept(tq: TransferQueue) -> None:
    for i in range(6):
        scored_group(tq, f"flat{i}", [0.0, 0.0], prompt_step=0)
    scored_group(tq, "mixed", [1.0, 0.0], prompt_step=1)  # consumed after the flat ones
    refills: list[int] = []
    s = sampler(tq, filter_budget=2.0)
    sample = s.sample(0, 3, no_signal_unless_mixed, refills.append)  # budget: 6 groups
    assert [g.group.uid for g in sample.kept] == ["mixed"]
    assert sample.budget_spent and sample.num_consumed == 7
    assert dict(sample.rejected) == {"no_signal": 6} and sum(refills) == 6


def test_without_a_kept_group_a_spent_budget_waits_until_the_stop_rule(tq: TransferQueue) -> None:
    for i in range(4):
        scored_group(tq, f"flat{i}", [0.0, 0.0])
    with pytest.raises(
        NoProgress, match=r"the filter rejected 4 of 4 groups as without signal \(all scored 0 4\)"
    ):
        sampler(tq, filter_budget=1.0, stall_s=20).sample(0, 2, no_signal_unless_mixed, print)
