"""Claiming named groups, and putting and claiming groups in one step, against a real
redis-server: what an agent runner needs so that nothing claims (and gives back) other groups to
find its own, and an agent's own group is never pending for another claimer to take."""

from __future__ import annotations

import pytest
import redis

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import ConflictError, InvalidInputError, TransferQueue

P = "train"


def group(uid: str, n: int = 2, step: int = 0, token: int = 1) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid, num_samples=n, prompt_step=step, prompt_token_ids=[token, 2, 3]
    )


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in client.scan_iter(count=1000)}


def events(tq: TransferQueue) -> list[tuple[str, str, str]]:
    return [(e.key, e.from_status, e.to_status) for e in tq.read_events(P, "-", 10_000)]


def test_only_the_named_pending_groups_are_claimed(tq: TransferQueue) -> None:
    tq.put_groups(P, [group("old", step=0), group("mine", step=5), group("other", step=1)])
    result = tq.claim_named_groups(P, ["mine"], claimer="runner-1", lease_s=60)
    assert [c.group.uid for c in result.claimed] == ["mine"] and result.not_claimed == {}
    assert result.claimed[0].missing_indices == [0, 1] and result.num_launched == 1
    # the older groups were never touched: no claim, no release, no event of theirs
    assert [(k, f, t) for k, f, t in events(tq) if t == "running"] == [
        ("mine", "pending", "running")
    ]
    rest = tq.claim_groups(P, max_groups=5, claimer="loop", lease_s=60).claimed
    assert sorted(c.group.uid for c in rest) == ["old", "other"]


def test_groups_that_cannot_be_claimed_say_why_and_change_nothing(tq: TransferQueue) -> None:
    tq.put_groups(P, [group("a"), group("b")])
    tq.claim_named_groups(P, ["a"], claimer="x", lease_s=60)
    before = snapshot(tq.redis)
    result = tq.claim_named_groups(P, ["a", "ghost"], claimer="y", lease_s=60)
    assert result.claimed == [] and result.not_claimed == {"a": "running", "ghost": "unknown"}
    after = snapshot(tq.redis)
    assert before == after
    with pytest.raises(InvalidInputError, match="appears twice"):
        tq.claim_named_groups(P, ["b", "b"], claimer="y", lease_s=60)


def test_the_launched_cap_holds_for_named_claims(tq: TransferQueue) -> None:
    tq.put_groups(P, [group("a"), group("b"), group("c")])
    result = tq.claim_named_groups(P, ["a", "b", "c"], claimer="r", lease_s=60, max_launched=2)
    assert [c.group.uid for c in result.claimed] == ["a", "b"]
    assert result.not_claimed == {"c": "throttled"} and result.num_launched == 2
    # the claim_groups loop sees the same counter: nothing more to launch
    assert (
        tq.claim_groups(P, max_groups=5, claimer="loop", lease_s=60, max_launched=2).claimed == []
    )


def test_put_and_claim_is_one_step_and_all_or_nothing(tq: TransferQueue) -> None:
    result = tq.put_and_claim_groups(
        P, [group("agent-1"), group("agent-2")], claimer="r", lease_s=60
    )
    assert [c.group.uid for c in result.claimed] == ["agent-1", "agent-2"]
    assert result.num_launched == 2
    # every event shows the group created and claimed together: never pending to anyone else
    assert events(tq) == [
        ("agent-1", "", "pending"),
        ("agent-2", "", "pending"),
        ("agent-1", "pending", "running"),
        ("agent-2", "pending", "running"),
    ]
    assert tq.claim_groups(P, max_groups=5, claimer="loop", lease_s=60).claimed == []

    # again with the same content: already claimed, said so, nothing written
    before = snapshot(tq.redis)
    again = tq.put_and_claim_groups(P, [group("agent-1")], claimer="r2", lease_s=60)
    assert again.claimed == [] and again.not_claimed == {"agent-1": "running"}
    assert snapshot(tq.redis) == before

    # a uid stored with other content: an error, and the other group of the call is not put
    with pytest.raises(ConflictError):
        tq.put_and_claim_groups(
            P, [group("agent-3"), group("agent-1", token=9)], claimer="r", lease_s=60
        )
    assert snapshot(tq.redis) == before

    # a full throttle: every group throttled, nothing put
    throttled = tq.put_and_claim_groups(
        P, [group("agent-4"), group("agent-5")], claimer="r", lease_s=60, max_launched=3
    )
    assert throttled.claimed == []
    assert throttled.not_claimed == {"agent-4": "throttled", "agent-5": "throttled"}
    assert snapshot(tq.redis) == before


def test_a_released_agent_group_can_be_claimed_again_by_name(tq: TransferQueue) -> None:
    (claim,) = tq.put_and_claim_groups(P, [group("g")], claimer="r", lease_s=60).claimed
    tq.release_groups(P, [claim], "the agent crashed; another try")
    result = tq.claim_named_groups(P, ["g"], claimer="r", lease_s=60)
    assert [c.group.uid for c in result.claimed] == ["g"] and result.claimed[
        0
    ].claim_id != claim.claim_id
