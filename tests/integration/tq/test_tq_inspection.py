"""Reading what the TransferQueue holds without knowing its keys, against a real redis-server:
group listings, leases, the event stream (last entries, following it, waiting for pending work),
dead letters, consumer groups, and the whole-partition snapshot an audit reads."""

from __future__ import annotations

import threading
import time

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    EventConsumer,
    GroupStatus,
    Lease,
    PendingEntry,
    TrajectoryPut,
    TransferQueue,
)

P = "train"


def groups(*uids: str, step: int = 0) -> list[common_pb2.PromptGroup]:
    return [
        common_pb2.PromptGroup(uid=uid, num_samples=1, prompt_step=step, prompt_token_ids=[1, 2])
        for uid in uids
    ]


def finish(tq: TransferQueue, uid: str) -> None:
    [claim] = tq.claim_named_groups(P, [uid], claimer="w", lease_s=60).claimed
    traj = common_pb2.Trajectory(uid=uid, index=0, response_token_ids=[3], response_mask=b"\x01")
    tq.put_trajectories(P, [TrajectoryPut(traj, claim.claim_id)])


def test_group_uids_lists_a_partition_whole_or_by_status(tq: TransferQueue) -> None:
    assert tq.group_uids(P) == []
    tq.put_groups(P, groups("b", "a", "c", "gs"))
    tq.put_groups("val", groups("v"))
    tq.claim_named_groups(P, ["c"], claimer="w", lease_s=60)
    assert tq.group_uids(P) == ["a", "b", "c", "gs"]  # nothing of "val", no index key
    assert tq.group_uids(P, GroupStatus.PENDING) == ["a", "b", "gs"]
    assert tq.group_uids(P, GroupStatus.RUNNING) == ["c"]
    assert tq.group_uids(P, GroupStatus.CONSUMED) == []
    assert tq.group_uids("val") == ["v"]


def test_leases_name_the_claimer_and_the_claim_earliest_deadline_first(tq: TransferQueue) -> None:
    tq.put_groups(P, groups("a", "b", "c"))
    before_ms = time.time() * 1000
    [long] = tq.claim_named_groups(P, ["a"], claimer="gw-a", lease_s=600).claimed
    [short] = tq.claim_named_groups(P, ["b"], claimer="gw-b", lease_s=60).claimed
    leases = tq.leases(P)
    assert [(x.uid, x.claim_id, x.claimer) for x in leases] == [
        ("b", short.claim_id, "gw-b"),
        ("a", long.claim_id, "gw-a"),
    ]
    assert all(isinstance(x, Lease) for x in leases)
    assert before_ms + 59_000 < leases[0].deadline_ms < time.time() * 1000 + 61_000
    tq.release_groups(P, {"b": short.claim_id})
    assert [x.uid for x in tq.leases(P)] == ["a"]
    assert tq.leases("val") == []


def test_last_and_following_events(tq: TransferQueue) -> None:
    assert tq.last_events(P) == []
    tq.put_groups(P, groups("a", "b", "c"))
    last_two = tq.last_events(P, 2)
    assert [(e.key, e.to_status) for e in last_two] == [("b", "pending"), ("c", "pending")]
    assert tq.follow_events(P, last_two[-1].id) == []  # nothing after it, and no wait
    assert [e.key for e in tq.follow_events(P, "0", count=2)] == ["a", "b"]
    assert [e.key for e in tq.follow_events(P, last_two[0].id, block_ms=10)] == ["c"]

    found: list[list[str]] = []  # the block stays below the test client's 5 s socket timeout
    waiter = threading.Thread(
        target=lambda: found.append([e.key for e in tq.follow_events(P, "$", block_ms=4_000)])
    )
    waiter.start()
    time.sleep(0.2)  # the read is blocked by now
    tq.put_groups(P, groups("d"))
    waiter.join(10)
    assert found == [["d"]]


def test_wait_for_pending_reports_the_last_event_and_whether_work_became_pending(
    tq: TransferQueue,
) -> None:
    tq.put_groups(P, groups("a"))
    last_id, pending = tq.wait_for_pending(P, "0", block_ms=10)
    assert pending and last_id == tq.last_events(P, 1)[0].id
    assert tq.wait_for_pending(P, last_id, block_ms=10) == (last_id, False)  # nothing new
    tq.claim_named_groups(P, ["a"], claimer="w", lease_s=60)
    claimed_id, pending = tq.wait_for_pending(P, last_id, block_ms=10)
    assert not pending and claimed_id == tq.last_events(P, 1)[0].id != last_id

    woken: list[tuple[str, bool]] = []
    waiter = threading.Thread(target=lambda: woken.append(tq.wait_for_pending(P, block_ms=4_000)))
    waiter.start()
    time.sleep(0.2)
    tq.put_groups(P, groups("b"))
    waiter.join(10)
    assert woken == [(tq.last_events(P, 1)[0].id, True)]


def test_consumer_groups_and_dead_letters(tq: TransferQueue) -> None:
    assert tq.consumer_groups(P) == {}  # no stream yet
    tq.put_groups(P, groups("a", "b", "c"))
    reader = EventConsumer(
        tq, P, group="reward", reader="r0", reclaim_idle_s=0.001, max_deliveries=2
    )
    EventConsumer(tq, P, group="late", reader="x", start_id="$")
    delivered = reader.read(count=2, block_s=0.1)
    reader.ack(delivered[:1])
    state = tq.consumer_groups(P)
    assert sorted(state) == ["late", "reward"]
    assert state["reward"].last_delivered_id == delivered[1].id
    assert state["reward"].pending == [PendingEntry(delivered[1].id, "r0", 1)]
    assert state["late"].last_delivered_id == tq.last_events(P, 1)[0].id
    assert state["late"].pending == []

    time.sleep(0.01)
    assert [e.key for e in reader.read(count=1, block_s=0.1)] == ["b"]  # reclaimed: 2nd delivery
    time.sleep(0.01)
    reader.read(count=1, block_s=0.1)  # b is given up on; c is delivered instead
    dead = tq.dead_letters(P)
    assert [(e.key, e.extra["dead_group"], e.extra["dead_deliveries"]) for e in dead] == [
        ("b", "reward", "2")
    ]
    assert reader.dead_letters() == dead
    assert tq.dead_letters("val") == []


def test_the_audit_snapshot_holds_the_whole_partition(tq: TransferQueue) -> None:
    tq.put_groups(P, groups("a", "b", "c", "d", "e"))
    finish(tq, "a")
    tq.claim_named_groups(P, ["b"], claimer="w", lease_s=60)
    reader = EventConsumer(tq, P, group="reward", reader="r0")
    delivered = reader.read(count=5, block_s=0.1)
    snapshot = tq.audit_snapshot(P, page=2)  # pages through events and pending entries
    assert list(snapshot.groups) == ["a", "b", "c", "d", "e"]
    assert [t.index for t in snapshot.groups["a"].trajectories] == [0]
    assert snapshot.groups["a"].group.tags.status == common_pb2.GROUP_STATUS_FINISHED
    assert [x.uid for x in snapshot.leases] == ["b"] and snapshot.leases == tq.leases(P)
    assert snapshot.events == tq.read_events(P, "-", 10_000)
    assert len(snapshot.events) == 9  # 5 puts, 2 claims, a's trajectory, a finished
    state = snapshot.consumer_groups["reward"]
    assert [p.id for p in state.pending] == [e.id for e in delivered] and len(delivered) == 5
    assert tq.audit_snapshot("val").groups == {}
