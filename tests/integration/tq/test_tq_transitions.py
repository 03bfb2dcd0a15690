"""Every group and trajectory transition of the TransferQueue, legal and illegal, against a real
redis-server: a legal one changes the status and appends exactly one event; an illegal one is an
error naming the key, the current and the requested status, and leaves Redis byte-for-byte
unchanged."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    GROUP_TRANSITIONS,
    GroupStatus,
    IllegalTransitionError,
    StaleClaimError,
    TrajectoryPut,
    TransferQueue,
)
from relayrl.tq.errors import UnknownKeyError
from relayrl.tq.reads import READ_CHUNK

P = "train"
OK = common_pb2.REWARD_STATUS_OK


def group(uid: str, n: int = 2, step: int = 0) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid, num_samples=n, prompt_step=step, prompt_token_ids=[1, 2, 3]
    )


def trajectory(uid: str, index: int, version: int = 0) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[7, 8, 9],
        response_mask=b"\x01\x01\x01",
        rollout_logprobs=[-0.5, -0.25, -0.125],
        spans=[common_pb2.GenerationSpan(start=0, end=3, policy_version=version)],
    )


def reward(score: float = 1.0, status: int = OK) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(status=status, score=score)


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in client.scan_iter(count=1000)}


def status_of(tq: TransferQueue, uid: str) -> GroupStatus:
    tags = tq.get_groups(P, [uid], with_trajectories=False)[0].group.tags
    return GroupStatus(common_pb2.GroupStatus.Name(tags.status)[len("GROUP_STATUS_") :].lower())


# -- bringing a group "g" to each status -------------------------------------------------------


def to_pending(tq: TransferQueue) -> str:
    tq.put_groups(P, [group("g")])
    return ""


def to_running(tq: TransferQueue) -> str:
    to_pending(tq)
    return tq.claim_groups(P, max_groups=1, claimer="t", lease_s=60).claimed[0].claim_id


def to_finished(tq: TransferQueue) -> str:
    claim = to_running(tq)
    tq.put_trajectories(P, [TrajectoryPut(trajectory("g", i), claim) for i in range(2)])
    return claim


def to_failed(tq: TransferQueue) -> str:
    claim = to_running(tq)
    tq.fail_groups(P, {"g": claim}, reason="engines down")
    return claim


def to_scored(tq: TransferQueue) -> str:
    claim = to_finished(tq)
    tq.score_trajectories(P, {"g_0": reward(1.0), "g_1": reward(0.0)})
    return claim


def to_consumed(tq: TransferQueue) -> str:
    claim = to_scored(tq)
    assert tq.consume(P, step=1, num_groups=1) == ["g"]
    return claim


def to_dropped(tq: TransferQueue) -> str:
    claim = to_finished(tq)
    tq.drop_groups(P, ["g"], reason="stale")
    return claim


SETUP: dict[GroupStatus, Callable[[TransferQueue], str]] = {
    GroupStatus.PENDING: to_pending,
    GroupStatus.RUNNING: to_running,
    GroupStatus.FINISHED: to_finished,
    GroupStatus.FAILED: to_failed,
    GroupStatus.SCORED: to_scored,
    GroupStatus.CONSUMED: to_consumed,
    GroupStatus.DROPPED: to_dropped,
}


def test_setup_reaches_every_status(tq: TransferQueue) -> None:
    for status, setup in SETUP.items():
        tq.redis.flushall()
        tq.create_partition(P)
        setup(tq)
        assert status_of(tq, "g") is status


# -- explicit transitions: every source status, legal or not ------------------------------------

# Operations that request one target status of a single group, given the group's claim id.
OPERATIONS: dict[str, tuple[GroupStatus, Callable[[TransferQueue, str], object]]] = {
    "release": (GroupStatus.PENDING, lambda tq, c: tq.release_groups(P, {"g": c or "c0"})),
    "fail": (GroupStatus.FAILED, lambda tq, c: tq.fail_groups(P, {"g": c or "c0"}, "x")),
    "reissue": (GroupStatus.PENDING, lambda tq, c: tq.reissue_groups(P, ["g"])),
    "drop": (GroupStatus.DROPPED, lambda tq, c: tq.drop_groups(P, ["g"], "stale")),
}


def _legal(op: str, source: GroupStatus) -> bool:
    target, _ = OPERATIONS[op]
    if op == "release":  # running -> pending through a release; failed -> pending is reissue
        return source is GroupStatus.RUNNING
    if op == "reissue":
        return source is GroupStatus.FAILED
    return (source, target) in GROUP_TRANSITIONS


@pytest.mark.parametrize("op", sorted(OPERATIONS))
@pytest.mark.parametrize("source", list(GroupStatus), ids=str)
def test_explicit_transition(tq: TransferQueue, op: str, source: GroupStatus) -> None:
    claim = SETUP[source](tq)
    target, call = OPERATIONS[op]
    events_before = len(tq.read_events(P))
    if _legal(op, source):
        call(tq, claim)
        assert status_of(tq, "g") is target
        events = tq.read_events(P)[events_before:]
        assert [(e.kind, e.key, e.from_status, e.to_status) for e in events] == [
            ("group", "g", source.value, target.value)
        ]
        return
    before = snapshot(tq.redis)
    with pytest.raises(IllegalTransitionError) as err:
        call(tq, claim)
    assert err.value.key == "g"
    assert err.value.current == source.value
    assert err.value.requested == target.value
    assert f"'{source.value}'" in str(err.value) and f"'{target.value}'" in str(err.value)
    assert snapshot(tq.redis) == before


@pytest.mark.parametrize("source", list(GroupStatus), ids=str)
def test_claim_takes_only_pending_groups(tq: TransferQueue, source: GroupStatus) -> None:
    SETUP[source](tq)
    claimed = tq.claim_groups(P, max_groups=5, claimer="t2", lease_s=60).claimed
    assert [c.group.uid for c in claimed] == (["g"] if source is GroupStatus.PENDING else [])


@pytest.mark.parametrize("source", list(GroupStatus), ids=str)
def test_consume_takes_only_scored_groups(tq: TransferQueue, source: GroupStatus) -> None:
    SETUP[source](tq)
    consumed = tq.consume(P, step=7, num_groups=5)
    assert consumed == (["g"] if source in (GroupStatus.SCORED,) else [])


@pytest.mark.parametrize("source", list(GroupStatus), ids=str)
def test_reset_consumption_touches_only_consumed_groups(
    tq: TransferQueue, source: GroupStatus
) -> None:
    SETUP[source](tq)
    reset = tq.reset_consumption(P, after_step=0)
    assert reset == (["g"] if source is GroupStatus.CONSUMED else [])
    expected = GroupStatus.SCORED if source is GroupStatus.CONSUMED else source
    assert status_of(tq, "g") is expected


@pytest.mark.parametrize("source", list(GroupStatus), ids=str)
def test_put_trajectory_needs_a_running_group(tq: TransferQueue, source: GroupStatus) -> None:
    tq.put_groups(P, [group("g", n=3)])
    claim = ""
    if source is not GroupStatus.PENDING:
        claim = tq.claim_groups(P, max_groups=1, claimer="t", lease_s=60).claimed[0].claim_id
    # Bring the 3-sample group to `source` while leaving sample 2 unwritten where possible.
    if source is GroupStatus.FAILED:
        tq.fail_groups(P, {"g": claim}, "x")
    if source in (GroupStatus.PENDING, GroupStatus.RUNNING, GroupStatus.FAILED):
        put = TrajectoryPut(trajectory("g", 2), claim or "c0")
        if source is GroupStatus.RUNNING:
            assert tq.put_trajectories(P, [put]).created == ["g_2"]
            return
        before = snapshot(tq.redis)
        with pytest.raises(StaleClaimError) as err:
            tq.put_trajectories(P, [put])
        assert err.value.current == source.value
        assert snapshot(tq.redis) == before


# -- automatic transitions ---------------------------------------------------------------------


def test_group_finishes_with_its_last_sample_and_is_scored_with_its_last_score(
    tq: TransferQueue,
) -> None:
    claim = to_running(tq)
    tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 0), claim)])
    assert status_of(tq, "g") is GroupStatus.RUNNING
    tq.score_trajectories(P, {"g_0": reward()})  # scored before its group finished
    tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 1), claim)])
    assert status_of(tq, "g") is GroupStatus.FINISHED
    tq.score_trajectories(P, {"g_1": reward()})
    assert status_of(tq, "g") is GroupStatus.SCORED
    transitions = [(e.key, e.from_status, e.to_status) for e in tq.read_events(P)]
    assert transitions == [
        ("g", "", "pending"),
        ("g", "pending", "running"),
        ("g_0", "", "finished"),
        ("g_0", "finished", "scored"),
        ("g_1", "", "finished"),
        ("g", "running", "finished"),
        ("g_1", "finished", "scored"),
        ("g", "finished", "scored"),
    ]


def test_failed_samples_settle_without_a_score(tq: TransferQueue) -> None:
    claim = to_running(tq)
    tq.put_trajectories(
        P,
        [
            TrajectoryPut(trajectory("g", 0), claim, failed=True),
            TrajectoryPut(trajectory("g", 1), claim),
        ],
    )
    tq.score_trajectories(P, {"g_1": reward()})
    batch = tq.get_groups(P, ["g"])[0]
    assert status_of(tq, "g") is GroupStatus.SCORED
    assert batch.group.tags.num_failed == 1 and batch.group.tags.num_scored == 1
    failed, scored = batch.trajectories
    assert failed.tags.is_infra and failed.tags.status == common_pb2.TRAJECTORY_STATUS_FAILED
    assert not failed.HasField("reward")
    assert not scored.tags.is_infra and scored.reward.score == 1.0


def test_group_whose_samples_all_failed_is_settled_at_once(tq: TransferQueue) -> None:
    claim = to_running(tq)
    tq.put_trajectories(
        P, [TrajectoryPut(trajectory("g", i), claim, failed=True) for i in range(2)]
    )
    assert status_of(tq, "g") is GroupStatus.SCORED


def test_scoring_a_failed_trajectory_is_illegal(tq: TransferQueue) -> None:
    claim = to_running(tq)
    tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 0), claim, failed=True)])
    before = snapshot(tq.redis)
    with pytest.raises(IllegalTransitionError) as err:
        tq.score_trajectories(P, {"g_0": reward()})
    assert (err.value.key, err.value.current, err.value.requested) == ("g_0", "failed", "scored")
    assert snapshot(tq.redis) == before


def test_infra_reward_marks_the_trajectory_infra(tq: TransferQueue) -> None:
    to_finished(tq)
    tq.score_trajectories(
        P,
        {
            "g_0": reward(0.0, common_pb2.REWARD_STATUS_TIMEOUT),
            "g_1": reward(0.0, common_pb2.REWARD_STATUS_POLICY_FAIL),
        },
    )
    timeout, policy_fail = tq.get_groups(P, ["g"])[0].trajectories
    assert timeout.tags.is_infra and timeout.tags.reward_status == common_pb2.REWARD_STATUS_TIMEOUT
    assert not policy_fail.tags.is_infra


def test_first_score_stands(tq: TransferQueue) -> None:
    to_finished(tq)
    assert tq.score_trajectories(P, {"g_0": reward(1.0)}) == ["g_0"]
    before = snapshot(tq.redis)
    assert tq.score_trajectories(P, {"g_0": reward(0.0)}) == []
    assert snapshot(tq.redis) == before
    assert tq.get_trajectories(P, ["g_0"])[0].reward.score == 1.0


def test_consume_is_idempotent_per_step_and_reset_undoes_later_steps(tq: TransferQueue) -> None:
    tq.put_groups(P, [group(f"g{i}", n=1, step=i % 2) for i in range(6)])
    claimed = tq.claim_groups(P, max_groups=6, claimer="t", lease_s=60).claimed
    tq.put_trajectories(
        P,
        [TrajectoryPut(trajectory(c.group.uid, 0), c.claim_id) for c in claimed],
    )
    tq.score_trajectories(P, {f"g{i}_0": reward() for i in range(6)})
    first = tq.consume(P, step=1, num_groups=2)
    assert len(first) == 2
    # Oldest prompt step first: step-0 groups are g0, g2, g4.
    assert set(first) <= {"g0", "g2", "g4"}
    assert tq.consume(P, step=1, num_groups=2) == first  # a retried step takes nothing new
    topped_up = tq.consume(P, step=1, num_groups=3)
    assert topped_up[:2] == first and len(topped_up) == 3
    second = tq.consume(P, step=2, num_groups=2)
    assert not set(second) & set(topped_up)
    assert sorted(tq.reset_consumption(P, after_step=1)) == sorted(second)
    assert tq.counts(P).groups[GroupStatus.CONSUMED] == 3
    assert tq.consume(P, step=2, num_groups=3) and tq.counts(P).groups[GroupStatus.SCORED] == 0


def test_release_keeps_written_trajectories_and_reclaim_reports_the_missing_ones(
    tq: TransferQueue,
) -> None:
    tq.put_groups(P, [group("g", n=4)])
    first = tq.claim_groups(P, max_groups=1, claimer="a", lease_s=60).claimed[0]
    assert first.missing_indices == [0, 1, 2, 3]
    tq.put_trajectories(P, [TrajectoryPut(trajectory("g", i), first.claim_id) for i in (0, 2)])
    assert tq.release_groups(P, [first]) == 1
    assert tq.counts(P).num_launched == 0
    second = tq.claim_groups(P, max_groups=1, claimer="b", lease_s=60).claimed[0]
    assert second.missing_indices == [1, 3]
    assert second.claim_id != first.claim_id
    with pytest.raises(StaleClaimError, match="superseded"):
        tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 1), first.claim_id)])
    # A retried put of a trajectory written under the old claim is still a harmless no-op.
    retried = tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 0), first.claim_id)])
    assert retried.duplicates == ["g_0"]


def test_expired_lease_requeues_and_renewal_keeps_it(tq: TransferQueue) -> None:
    tq.put_groups(P, [group("a"), group("b")])
    claimed = tq.claim_groups(P, max_groups=2, claimer="t", lease_s=0.05).claimed
    tq.renew_leases(P, [c for c in claimed if c.group.uid == "a"], lease_s=60)
    requeued: list[str] = []
    deadline = time.monotonic() + 10
    while not requeued and time.monotonic() < deadline:
        time.sleep(0.01)
        requeued = tq.requeue_expired(P)
    assert requeued == ["b"]
    assert status_of(tq, "a") is GroupStatus.RUNNING
    assert status_of(tq, "b") is GroupStatus.PENDING
    assert tq.read_events(P)[-1].extra == {"reason": "lease_expired"}
    with pytest.raises(StaleClaimError):
        tq.renew_leases(P, [c for c in claimed if c.group.uid == "b"], lease_s=60)


def test_a_claimer_that_starts_takes_back_what_its_dead_predecessor_left(
    tq: TransferQueue,
) -> None:
    """Every claim under the name goes back to pending at once, long before its lease ends;
    another claimer's stays, and the dead process's late writes are refused."""
    tq.put_groups(P, [group("a", n=2), group("b"), group("c")])
    mine = tq.claim_named_groups(P, ["a", "b"], claimer="gateway-0", lease_s=600).claimed
    other = tq.claim_named_groups(P, ["c"], claimer="gateway-1", lease_s=600).claimed
    tq.put_trajectories(P, [TrajectoryPut(trajectory("a", 0), mine[0].claim_id)])
    assert tq.counts(P).num_launched == 3
    released = tq.release_claimer(P, "gateway-0", "released by a restarted claimer")
    assert sorted(released) == sorted(c.group.uid for c in mine)
    assert [lease.uid for lease in tq.leases(P)] == [other[0].group.uid]
    assert tq.counts(P).num_launched == 1
    assert tq.read_events(P)[-1].extra == {"reason": "released by a restarted claimer"}
    with pytest.raises(StaleClaimError):
        tq.put_trajectories(P, [TrajectoryPut(trajectory("a", 1), mine[0].claim_id)])
    again = {
        c.group.uid: c for c in tq.claim_groups(P, max_groups=2, claimer="g", lease_s=60).claimed
    }
    assert again["a"].missing_indices == [1]  # the trajectory written before the death stays
    assert tq.release_claimer(P, "gateway-0", "x") == []


def test_claim_respects_the_launched_cap_across_calls(tq: TransferQueue) -> None:
    tq.put_groups(P, [group(f"g{i}") for i in range(10)])
    first = tq.claim_groups(P, max_groups=4, claimer="a", lease_s=60, max_launched=6)
    second = tq.claim_groups(P, max_groups=4, claimer="b", lease_s=60, max_launched=6)
    assert (len(first.claimed), len(second.claimed)) == (4, 2)
    assert second.num_launched == 6
    tq.release_groups(P, first.claimed[:1])
    third = tq.claim_groups(P, max_groups=4, claimer="c", lease_s=60, max_launched=6)
    assert len(third.claimed) == 1


def test_reissue_restamps_the_prompt_step(tq: TransferQueue) -> None:
    to_failed(tq)
    tq.reissue_groups(P, ["g"], prompt_step=5)
    claimed = tq.claim_groups(P, max_groups=1, claimer="t", lease_s=60).claimed[0]
    assert claimed.group.prompt_step == 5 and claimed.group.tags.prompt_step == 5
    assert tq.staleness(P, step=6)[GroupStatus.RUNNING] == {2: 1}


def test_put_groups_is_idempotent(tq: TransferQueue) -> None:
    assert tq.put_groups(P, [group("g")]).created == ["g"]
    before = snapshot(tq.redis)
    again = tq.put_groups(P, [group("g")])
    assert again.created == [] and again.duplicates == ["g"]
    assert snapshot(tq.redis) == before
    # Queue-owned fields a caller echoes back do not make it a different group.
    echoed = group("g")
    echoed.tags.status = common_pb2.GROUP_STATUS_RUNNING
    echoed.partition = P
    assert tq.put_groups(P, [echoed]).duplicates == ["g"]


def test_put_trajectories_is_idempotent(tq: TransferQueue) -> None:
    claim = to_running(tq)
    put = TrajectoryPut(trajectory("g", 0), claim)
    assert tq.put_trajectories(P, [put]).created == ["g_0"]
    before = snapshot(tq.redis)
    assert tq.put_trajectories(P, [put, put]).duplicates == ["g_0", "g_0"]
    assert snapshot(tq.redis) == before


def test_counts_and_staleness(tq: TransferQueue) -> None:
    tq.put_groups(P, [group(f"g{i}", n=1, step=i) for i in range(4)])
    claimed = tq.claim_groups(P, max_groups=2, claimer="t", lease_s=60).claimed
    tq.put_trajectories(
        P, [TrajectoryPut(trajectory(claimed[0].group.uid, 0), claimed[0].claim_id)]
    )
    counts = tq.counts(P)
    assert counts.groups[GroupStatus.PENDING] == 2
    assert counts.groups[GroupStatus.RUNNING] == 1
    assert counts.groups[GroupStatus.FINISHED] == 1
    assert counts.num_launched == 2
    staleness = tq.staleness(P, step=3)
    assert staleness[GroupStatus.FINISHED] == {4: 1}  # g0: 3 - 0 + 1
    assert staleness[GroupStatus.RUNNING] == {3: 1}  # g1
    assert staleness[GroupStatus.PENDING] == {1: 1, 2: 1}  # g3, g2


def test_round_trip_keeps_every_field(tq: TransferQueue) -> None:
    claim = to_running(tq)
    original = trajectory("g", 1, version=3)
    original.spans.append(common_pb2.GenerationSpan(start=3, end=3, policy_version=4, turn=1))
    original.labels["task"] = "arith"
    tq.put_trajectories(P, [TrajectoryPut(original, claim)])
    stored = tq.get_trajectories(P, ["g_1"])[0]
    assert stored.tags.min_policy_version == 3 and stored.tags.max_policy_version == 4
    assert stored.tags.prompt_len == 3 and stored.tags.response_len == 3
    assert stored.partition == P
    stored.ClearField("tags")
    stored.partition = ""
    assert stored == original


def test_reads_of_more_trajectories_than_one_script_reads_keep_their_order(
    tq: TransferQueue,
) -> None:
    """Trajectories are read READ_CHUNK to a script: a read across chunks returns each in the
    order asked, a group's in index order, and a key missing from a later chunk is named."""
    n = READ_CHUNK + 40
    tq.put_groups(P, [group("big", n=n)])
    (claim,) = tq.claim_groups(P, max_groups=1, claimer="gw", lease_s=60).claimed
    tq.put_trajectories(P, [TrajectoryPut(trajectory("big", i), claim.claim_id) for i in range(n)])
    keys = [f"big_{i}" for i in reversed(range(n))]
    assert [t.index for t in tq.get_trajectories(P, keys)] == list(reversed(range(n)))
    (read,) = tq.get_groups(P, ["big"])
    assert [t.index for t in read.trajectories] == list(range(n))
    with pytest.raises(UnknownKeyError, match=f"big_{n}"):
        tq.get_trajectories(P, [*keys, f"big_{n}"])
