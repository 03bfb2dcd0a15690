"""Pure-logic checks of the TransferQueue's codec, transition table and error translation."""

from __future__ import annotations

import pytest
import redis

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import codec
from relayrl.tq.errors import (
    ConflictError,
    IllegalTransitionError,
    InvalidInputError,
    StaleClaimError,
    UnknownPartitionError,
)
from relayrl.tq.model import GROUP_TRANSITIONS, GroupStatus, sources_of
from relayrl.tq.scripts import translate_error


def test_trajectory_keys_round_trip() -> None:
    assert codec.trajectory_key("abc-1.2", 7) == "abc-1.2_7"
    assert codec.split_trajectory_key("abc-1.2_7") == ("abc-1.2", 7)
    for bad in ("abc", "abc_", "_3", "a_b_3", 5):
        with pytest.raises(InvalidInputError):
            codec.split_trajectory_key(bad)


def test_uid_rules() -> None:
    assert codec.check_uid("step3:prompt-17.a") == "step3:prompt-17.a"
    for bad in ("", "a_b", "-lead", "x" * 129, "sp ace", None):
        with pytest.raises(InvalidInputError):
            codec.check_uid(bad)


def test_stored_bytes_ignore_queue_owned_fields() -> None:
    plain = common_pb2.Trajectory(uid="u", index=0, response_token_ids=[1], response_mask=b"\x01")
    echoed = common_pb2.Trajectory()
    echoed.CopyFrom(plain)
    echoed.partition = "train"
    echoed.tags.status = common_pb2.TRAJECTORY_STATUS_SCORED
    echoed.reward.score = 1.0
    a = codec.encode_trajectory(plain, "train", 1 << 20)
    b = codec.encode_trajectory(echoed, "train", 1 << 20)
    assert a.data == b.data and a.digest == b.digest
    assert echoed.reward.score == 1.0, "the caller's message is not modified"


def test_decode_fills_tags_from_hash_fields() -> None:
    encoded = codec.encode_trajectory(
        common_pb2.Trajectory(
            uid="u",
            index=1,
            response_token_ids=[4, 5],
            response_mask=b"\x01\x00",
            spans=[common_pb2.GenerationSpan(start=0, end=1, policy_version=2)],
        ),
        "val",
        1 << 20,
    )
    fields = {
        b"status": b"scored",
        b"response_len": b"2",
        b"min_v": b"2",
        b"max_v": b"2",
        b"is_infra": b"1",
        b"reward": common_pb2.RewardResult(
            status=common_pb2.REWARD_STATUS_INFRA_ERROR
        ).SerializeToString(),
    }
    traj = codec.decode_trajectory("val", "u_1", fields, encoded.data)
    assert traj.partition == "val"
    assert traj.tags.status == common_pb2.TRAJECTORY_STATUS_SCORED
    assert traj.tags.is_infra and traj.tags.max_policy_version == 2
    assert traj.tags.reward_status == common_pb2.REWARD_STATUS_INFRA_ERROR


def test_every_status_is_reachable_and_only_dropped_is_final() -> None:
    targets = {dst for (_, dst) in GROUP_TRANSITIONS}
    assert targets == set(GroupStatus)
    sources = {src for (src, _) in GROUP_TRANSITIONS if src is not None}
    assert set(GroupStatus) - sources == {GroupStatus.DROPPED}


def test_sources_of_each_operation() -> None:
    assert sources_of("reissue_groups") == [GroupStatus.FAILED]
    assert sources_of("drop_groups") == [GroupStatus.FINISHED, GroupStatus.SCORED]
    assert sources_of("release_groups") == [GroupStatus.RUNNING]
    assert sources_of("consume") == [GroupStatus.SCORED]


@pytest.mark.parametrize(
    ("reply", "error", "text"),
    [
        ("RELAYRL\tUNKNOWN_PARTITION\tfoo", UnknownPartitionError, "'foo'"),
        ("RELAYRL\tCONFLICT\tg1", ConflictError, "train/g1"),
        ("RELAYRL\tILLEGAL_TRANSITION\tg\tpending\tscored", IllegalTransitionError, "'pending'"),
        ("RELAYRL\tSTALE_CLAIM\tg\tpending\tfinished\tgone", StaleClaimError, "gone"),
        ("RELAYRL\tBAD_INDEX\tg_9\t9\t4", InvalidInputError, "index 9"),
    ],
)
def test_script_errors_become_typed_exceptions(reply: str, error: type, text: str) -> None:
    translated = translate_error("train", redis.ResponseError(reply))
    assert isinstance(translated, error)
    assert text in str(translated)


def test_other_redis_errors_pass_through() -> None:
    original = redis.ResponseError("ERR something else")
    assert translate_error("train", original) is original


def test_policy_versions_ignore_observation_spans() -> None:
    traj = common_pb2.Trajectory(uid="g", index=0, prompt_token_ids=[1], response_token_ids=[5] * 6)
    traj.response_mask = b"\x01\x01\x00\x00\x01\x01"
    traj.spans.add(start=0, end=2, policy_version=4, generated=True)
    traj.spans.add(start=2, end=4, policy_version=-1, generated=False)  # a tool's output
    traj.spans.add(start=4, end=6, policy_version=5, generated=True)
    encoded = codec.encode_trajectory(traj, "train", 1 << 20)
    assert (encoded.min_policy_version, encoded.max_policy_version) == (4, 5)
