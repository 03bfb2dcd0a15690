"""Bad input to the TransferQueue: a clear exception that says what to fix, and Redis unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    ConflictError,
    CorruptRecordError,
    EventConsumer,
    InvalidInputError,
    StaleClaimError,
    TQUnavailableError,
    TrajectoryPut,
    TransferQueue,
    UnknownKeyError,
    UnknownPartitionError,
)
from relayrl.tq.server import RedisServer
from relayrl.tq.testing import key_prefix_for_tests

P = "train"


def group(uid: str = "g", n: int = 2) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(uid=uid, num_samples=n, prompt_token_ids=[1, 2, 3])


def trajectory(uid: str = "g", index: int = 0, tokens: int = 3) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[5] * tokens,
        response_mask=b"\x01" * tokens,
        rollout_logprobs=[-1.0] * tokens,
    )


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in client.scan_iter(count=1000)}


@pytest.fixture
def running(tq: TransferQueue) -> str:
    """A running group "g" of 2 samples; returns its claim id."""
    tq.put_groups(P, [group()])
    return tq.claim_groups(P, max_groups=1, claimer="t", lease_s=60).claimed[0].claim_id


def assert_rejected(
    tq: TransferQueue, call: Callable[[], object], error: type[Exception], match: str
) -> None:
    before = snapshot(tq.redis)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(tq.redis) == before


UNKNOWN_PARTITION_CALLS: dict[str, Callable[[TransferQueue], object]] = {
    "put_groups": lambda tq: tq.put_groups("nope", [group()]),
    "claim_groups": lambda tq: tq.claim_groups("nope", max_groups=1, claimer="t", lease_s=1),
    "put_trajectories": lambda tq: tq.put_trajectories("nope", [TrajectoryPut(trajectory(), "c1")]),
    "score_trajectories": lambda tq: tq.score_trajectories(
        "nope", {"g_0": common_pb2.RewardResult(status=common_pb2.REWARD_STATUS_OK)}
    ),
    "consume": lambda tq: tq.consume("nope", step=1, num_groups=1),
    "reset_consumption": lambda tq: tq.reset_consumption("nope", after_step=0),
    "drop_groups": lambda tq: tq.drop_groups("nope", ["g"], "x"),
    "requeue_expired": lambda tq: tq.requeue_expired("nope"),
    "release_claimer": lambda tq: tq.release_claimer("nope", "gw", "x"),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN_PARTITION_CALLS))
def test_unknown_partition(tq: TransferQueue, running: str, name: str) -> None:
    assert_rejected(tq, lambda: UNKNOWN_PARTITION_CALLS[name](tq), UnknownPartitionError, "nope")


@pytest.mark.parametrize("bad", ["Train", "", "a b", "x" * 65, 3, None])
def test_bad_partition_name(tq: TransferQueue, bad: object) -> None:
    assert_rejected(tq, lambda: tq.put_groups(bad, [group()]), InvalidInputError, "partition")


def test_malformed_bytes(tq: TransferQueue, running: str) -> None:
    assert_rejected(tq, lambda: tq.put_groups(P, [b"\xff\xff\xff"]), InvalidInputError, "malformed")
    assert_rejected(
        tq,
        lambda: tq.put_trajectories(P, [TrajectoryPut(b"\x0a\x05ab", running)]),
        InvalidInputError,
        "malformed Trajectory",
    )
    assert_rejected(
        tq,
        lambda: tq.score_trajectories(P, {"g_0": b"\x08"}),
        InvalidInputError,
        "malformed RewardResult",
    )


def test_bytes_that_parse_but_make_no_group(tq: TransferQueue) -> None:
    # Valid protobuf, but no uid: a serialised message of another type, say.
    stranger = common_pb2.WeightVersion(version=3).SerializeToString()
    assert_rejected(tq, lambda: tq.put_groups(P, [stranger]), InvalidInputError, "uid")


def test_oversized_value(redis_server: RedisServer) -> None:
    tq = TransferQueue(redis_server.client(), max_value_bytes=4096)
    tq.create_partition(P)
    tq.put_groups(P, [group()])
    claim = tq.claim_groups(P, max_groups=1, claimer="t", lease_s=60).claimed[0].claim_id
    big = trajectory(tokens=2000)
    assert_rejected(
        tq,
        lambda: tq.put_trajectories(P, [TrajectoryPut(big, claim)]),
        InvalidInputError,
        r"'g_0' serialises to \d+ bytes, over the TransferQueue limit of 4096",
    )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda tq, c: tq.put_groups(P, ["g"]), "PromptGroup message or its serialised bytes"),
        (lambda tq, c: tq.put_groups(P, [trajectory()]), "not Trajectory"),
        (lambda tq, c: tq.put_trajectories(P, [trajectory()]), "TrajectoryPut items"),
        (lambda tq, c: tq.put_trajectories(P, [TrajectoryPut(group(), c)]), "Trajectory message"),
        (lambda tq, c: tq.score_trajectories(P, {"g_0": 1.0}), "RewardResult"),
        (lambda tq, c: tq.claim_groups(P, max_groups="2", claimer="t", lease_s=1), "max_groups"),
        (lambda tq, c: tq.claim_groups(P, max_groups=2, claimer="", lease_s=1), "claimer"),
        (lambda tq, c: tq.claim_groups(P, max_groups=2, claimer="t", lease_s=0), "lease_s"),
        (lambda tq, c: tq.consume(P, step=-1, num_groups=1), "step"),
        (lambda tq, c: tq.consume(P, step=True, num_groups=1), "step"),
        (lambda tq, c: tq.release_groups(P, {"g": 5}), "claim id"),
        (lambda tq, c: tq.drop_groups(P, ["g", "g"], "x"), "appears twice"),
        (lambda tq, c: tq.score_trajectories(P, {"g-0": _ok()}), "'<uid>_<index>'"),
        (lambda tq, c: tq.score_trajectories(P, {"g_0": common_pb2.RewardResult()}), "no status"),
    ],
)
def test_wrong_types_and_values(tq: TransferQueue, running: str, call, match: str) -> None:
    assert_rejected(tq, lambda: call(tq, running), InvalidInputError, match)


def _ok() -> common_pb2.RewardResult:
    return common_pb2.RewardResult(status=common_pb2.REWARD_STATUS_OK)


def _edit(**changes) -> common_pb2.Trajectory:
    traj = trajectory()
    for name, value in changes.items():
        if name == "spans":
            traj.spans.extend(value)
        elif name == "segments":
            traj.segments.extend(value)
        else:
            traj.ClearField(name)
            field = getattr(traj, name)
            field.extend(value) if hasattr(field, "extend") else setattr(traj, name, value)
    return traj


@pytest.mark.parametrize(
    ("traj", "match"),
    [
        (_edit(response_mask=b"\x01\x01"), "response_mask has 2 entries for 3"),
        (_edit(response_mask=b"\x01\x02\x01"), "must be 0 or 1"),
        (_edit(rollout_logprobs=[-1.0]), "rollout_logprobs has 1 entries for 3"),
        (_edit(spans=[common_pb2.GenerationSpan(start=2, end=9)]), r"span \[2, 9\)"),
        (_edit(uid="g_x"), "bad trajectory uid"),
        (_edit(index=-1), "index must be >= 0"),
        (_edit(partition="val"), "says partition 'val'"),
        (_edit(index=5), "index 5 is outside its group's 2 samples"),
        (
            _edit(segments=[common_pb2.TrajectorySegment(response_token_ids=[5, 6])]),
            "segment 0: response_mask has 0 entries for 2",
        ),
    ],
)
def test_malformed_trajectory(tq: TransferQueue, running: str, traj, match: str) -> None:
    assert_rejected(
        tq, lambda: tq.put_trajectories(P, [TrajectoryPut(traj, running)]), InvalidInputError, match
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_samples": 0}, "num_samples must be in"),
        ({"uid": ""}, "bad prompt group uid"),
        ({"prompt_step": -2}, "prompt_step must be >= 0"),
        ({"partition": "val"}, "says partition 'val'"),
    ],
)
def test_malformed_group(tq: TransferQueue, changes: dict, match: str) -> None:
    bad = group()
    for name, value in changes.items():
        setattr(bad, name, value)
    assert_rejected(tq, lambda: tq.put_groups(P, [bad]), InvalidInputError, match)
    empty = common_pb2.PromptGroup(uid="e", num_samples=1)
    assert_rejected(tq, lambda: tq.put_groups(P, [empty]), InvalidInputError, "prompt_token_ids")


def test_a_bad_item_rejects_the_whole_batch(tq: TransferQueue, running: str) -> None:
    tq.put_groups(P, [group("other")])
    changed = group("other", n=3)
    batch = [group("new1"), group("new2"), changed]
    assert_rejected(tq, lambda: tq.put_groups(P, batch), ConflictError, "other")
    good = TrajectoryPut(trajectory("g", 0), running)
    stale = TrajectoryPut(trajectory("g", 1), "c999")
    assert_rejected(tq, lambda: tq.put_trajectories(P, [good, stale]), StaleClaimError, "c999")
    assert_rejected(
        tq,
        lambda: tq.put_trajectories(P, [good, TrajectoryPut(trajectory("ghost", 0), running)]),
        UnknownKeyError,
        "ghost",
    )


def test_conflicting_trajectory(tq: TransferQueue, running: str) -> None:
    tq.put_trajectories(P, [TrajectoryPut(trajectory(), running)])
    other = trajectory(tokens=4)
    assert_rejected(
        tq,
        lambda: tq.put_trajectories(P, [TrajectoryPut(other, running)]),
        ConflictError,
        "train/g_0 already exists with different content",
    )


def test_unknown_keys(tq: TransferQueue) -> None:
    assert_rejected(tq, lambda: tq.score_trajectories(P, {"x_0": _ok()}), UnknownKeyError, "x_0")
    assert_rejected(tq, lambda: tq.get_groups(P, ["x"]), UnknownKeyError, "train/x does not")
    assert_rejected(tq, lambda: tq.get_trajectories(P, ["x_1"]), UnknownKeyError, "x_1")


def test_corrupt_record_is_reported_with_its_key(tq: TransferQueue) -> None:
    tq.put_groups(P, [group()])
    tq.redis.hset(key_prefix_for_tests(tq.namespace, P) + "g:g", "data", b"\xff\xfe garbage")
    with pytest.raises(CorruptRecordError, match="train/g holds an undecodable record"):
        tq.get_groups(P, ["g"])


def test_redis_down_is_a_clear_error(tmp_path) -> None:
    server = RedisServer(tmp_path / "r")
    server.start()
    tq = TransferQueue(server.client(socket_connect_timeout=0.5))
    tq.create_partition(P)
    server.kill()
    with pytest.raises(TQUnavailableError, match="unavailable"):
        tq.put_groups(P, [group()])


def test_bad_consumer_settings(tq: TransferQueue) -> None:
    with pytest.raises(InvalidInputError, match="max_deliveries"):
        EventConsumer(tq, P, group="reward", reader="r", max_deliveries=0)
    with pytest.raises(InvalidInputError, match="reader"):
        EventConsumer(tq, P, group="reward", reader="")
