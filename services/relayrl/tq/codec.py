"""Validation and (de)serialisation of what the TransferQueue stores.

Groups and trajectories are stored as their protobuf bytes (token ids, logprobs and masks as
packed arrays) with the queue-owned parts (tags, reward) cleared; those live in hash fields
next to the bytes and are merged back on read. Everything is checked here, before any command
reaches Redis, so bad input leaves Redis unchanged.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq.errors import CorruptRecordError, InvalidInputError

UID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,127}")
PARTITION_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")
MAX_SAMPLES_PER_GROUP = 4096


def check_partition_name(partition: object) -> str:
    if not isinstance(partition, str) or not PARTITION_PATTERN.fullmatch(partition):
        raise InvalidInputError(
            f"bad partition name {partition!r}: use 1-64 characters [a-z0-9_-], "
            "starting with a letter"
        )
    return partition


def check_uid(uid: object, what: str = "uid") -> str:
    if not isinstance(uid, str) or not UID_PATTERN.fullmatch(uid):
        raise InvalidInputError(
            f"bad {what} {uid!r}: use 1-128 characters [A-Za-z0-9.:-] (no '_': trajectory "
            "keys are '<uid>_<index>')"
        )
    return uid


def trajectory_key(uid: str, index: int) -> str:
    return f"{uid}_{index}"


def split_trajectory_key(key: object) -> tuple[str, int]:
    if isinstance(key, str):
        uid, sep, index = key.rpartition("_")
        if sep and index.isdigit() and UID_PATTERN.fullmatch(uid):
            return uid, int(index)
    raise InvalidInputError(f"bad trajectory key {key!r}: expected '<uid>_<index>'")


def digest(data: bytes) -> str:
    # Computed client-side so Redis does not spend its single thread hashing payloads; sha256
    # runs on the CPU's SHA extensions (9 us for 13.6 KB here, blake2b 16 us).
    return hashlib.sha256(data).hexdigest()[:32]


def _parse(cls: type, value: object, what: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        message = cls()
        try:
            message.ParseFromString(bytes(value))
        except DecodeError as exc:
            raise InvalidInputError(f"malformed {cls.__name__} bytes for {what}: {exc}") from None
        return message
    raise InvalidInputError(
        f"{what} must be a {cls.__name__} message or its serialised bytes, "
        f"not {type(value).__name__}"
    )


def _check_size(data: bytes, what: str, max_value_bytes: int) -> None:
    if len(data) > max_value_bytes:
        raise InvalidInputError(
            f"{what} serialises to {len(data)} bytes, over the TransferQueue limit of "
            f"{max_value_bytes} bytes (tq.max_value_bytes); keep large payloads in an object "
            "store and reference them (Trajectory.attachments)"
        )


@dataclass(frozen=True)
class EncodedGroup:
    uid: str
    prompt_step: int
    num_samples: int
    digest: str
    data: bytes


def encode_group(value: object, partition: str, max_value_bytes: int) -> EncodedGroup:
    group = _parse(common_pb2.PromptGroup, value, "a prompt group")
    uid = check_uid(group.uid, "prompt group uid")
    where = f"prompt group {uid!r}"
    if group.partition and group.partition != partition:
        raise InvalidInputError(
            f"{where} says partition {group.partition!r} but is put into {partition!r}"
        )
    if not 1 <= group.num_samples <= MAX_SAMPLES_PER_GROUP:
        raise InvalidInputError(
            f"{where}: num_samples must be in [1, {MAX_SAMPLES_PER_GROUP}], got {group.num_samples}"
        )
    if group.prompt_step < 0:
        raise InvalidInputError(f"{where}: prompt_step must be >= 0, got {group.prompt_step}")
    if not group.prompt_token_ids and not group.messages:
        raise InvalidInputError(f"{where}: give prompt_token_ids or messages")
    data = _stored_form(group, _GROUP_OWNED).SerializeToString(deterministic=True)
    _check_size(data, where, max_value_bytes)
    return EncodedGroup(uid, group.prompt_step, group.num_samples, digest(data), data)


@dataclass(frozen=True)
class EncodedTrajectory:
    uid: str
    index: int
    key: str
    digest: str
    data: bytes
    prompt_len: int
    response_len: int
    min_policy_version: int
    max_policy_version: int


def _check_trajectory_shape(
    traj: common_pb2.Trajectory | common_pb2.TrajectorySegment, where: str
) -> None:
    """One mask byte and one log-prob per response token; spans inside the response."""
    num_tokens = len(traj.response_token_ids)
    if len(traj.response_mask) != num_tokens:
        raise InvalidInputError(
            f"{where}: response_mask has {len(traj.response_mask)} entries for "
            f"{num_tokens} response tokens"
        )
    if traj.rollout_logprobs and len(traj.rollout_logprobs) != num_tokens:
        raise InvalidInputError(
            f"{where}: rollout_logprobs has {len(traj.rollout_logprobs)} entries for "
            f"{num_tokens} response tokens"
        )
    if traj.response_mask.translate(None, b"\x00\x01"):
        raise InvalidInputError(f"{where}: response_mask bytes must be 0 or 1")
    for span in traj.spans:
        if not 0 <= span.start <= span.end <= num_tokens:
            raise InvalidInputError(
                f"{where}: generation span [{span.start}, {span.end}) is outside the "
                f"{num_tokens} response tokens"
            )


def _stored_form(message, owned: frozenset[str]):
    """The message as stored: without the fields that its key (partition) or the queue (tags,
    reward) owns, so a retried put has the same bytes whatever it carried. Copied only when one
    of them is set: most writers never set them, and copying 10+ KB per trajectory costs."""
    if not owned.intersection(field.name for field, _ in message.ListFields()):
        return message
    copy = type(message)()
    copy.CopyFrom(message)
    for name in owned:
        copy.ClearField(name)
    return copy


_GROUP_OWNED = frozenset({"partition", "tags"})
_TRAJECTORY_OWNED = frozenset({"partition", "tags", "reward"})


def encode_trajectory(value: object, partition: str, max_value_bytes: int) -> EncodedTrajectory:
    traj = _parse(common_pb2.Trajectory, value, "a trajectory")
    uid = check_uid(traj.uid, "trajectory uid")
    if traj.index < 0:
        raise InvalidInputError(f"trajectory of {uid!r}: index must be >= 0, got {traj.index}")
    key = trajectory_key(uid, traj.index)
    where = f"trajectory {key!r}"
    if traj.partition and traj.partition != partition:
        raise InvalidInputError(
            f"{where} says partition {traj.partition!r} but is put into {partition!r}"
        )
    _check_trajectory_shape(traj, where)
    for k, segment in enumerate(traj.segments):
        _check_trajectory_shape(segment, f"{where} segment {k}")
    data = _stored_form(traj, _TRAJECTORY_OWNED).SerializeToString(deterministic=True)
    _check_size(data, where, max_value_bytes)
    # Observation spans (tool output, mask 0) were not sampled by any policy version; a writer
    # that marks no span as generated gets every span counted. A sample's segments count too.
    parts = [traj, *traj.segments]
    spans = [span for part in parts for span in part.spans]
    sampled = [span for span in spans if span.generated] or spans
    versions = [span.policy_version for span in sampled] or [0]
    return EncodedTrajectory(
        uid=uid,
        index=traj.index,
        key=key,
        digest=digest(data),
        data=data,
        prompt_len=sum(len(part.prompt_token_ids) for part in parts),
        response_len=sum(len(part.response_token_ids) for part in parts),
        min_policy_version=min(versions),
        max_policy_version=max(versions),
    )


def encode_reward(value: object, key: str, max_value_bytes: int) -> tuple[bytes, int]:
    """The reward's stored bytes and its RewardStatus."""
    result = _parse(common_pb2.RewardResult, value, f"the reward of {key!r}")
    if result.status == common_pb2.REWARD_STATUS_UNSPECIFIED:
        raise InvalidInputError(
            f"the reward of {key!r} has no status: set RewardResult.status (OK, POLICY_FAIL, "
            "or the failure that prevented scoring)"
        )
    data = result.SerializeToString(deterministic=True)
    _check_size(data, f"the reward of {key!r}", max_value_bytes)
    return data, result.status


def _int(fields: dict[bytes, bytes], name: bytes, default: int = 0) -> int:
    raw = fields.get(name)
    return int(raw) if raw is not None else default


def decode_group(partition: str, uid: str, fields: dict[bytes, bytes]) -> common_pb2.PromptGroup:
    group = common_pb2.PromptGroup()
    try:
        group.ParseFromString(fields[b"data"])
        status = common_pb2.GroupStatus.Value(f"GROUP_STATUS_{fields[b'status'].decode().upper()}")
    except (KeyError, ValueError, DecodeError) as exc:
        raise CorruptRecordError(partition, uid, repr(exc)) from None
    group.partition = partition
    tags = group.tags
    tags.status = status
    # A reissued group is re-stamped with a newer step; the stored hash field is the truth.
    group.prompt_step = tags.prompt_step = _int(fields, b"step", group.prompt_step)
    tags.consumed_step = _int(fields, b"consumed_step")
    tags.num_finished = _int(fields, b"num_put") - _int(fields, b"num_failed")
    tags.num_failed = _int(fields, b"num_failed")
    tags.num_scored = _int(fields, b"num_scored")
    tags.num_claims = _int(fields, b"num_claims")
    tags.reason = fields.get(b"reason", b"").decode()
    return group


def decode_trajectory(
    partition: str, key: str, fields: dict[bytes, bytes], data: bytes | None
) -> common_pb2.Trajectory:
    """A trajectory from its hash fields (status, tags, reward) and its stored bytes."""
    traj = common_pb2.Trajectory()
    try:
        if data is None:
            raise KeyError("its bytes are missing")
        traj.ParseFromString(data)
        status_name = fields[b"status"].decode().upper()
        traj.tags.status = common_pb2.TrajectoryStatus.Value(f"TRAJECTORY_STATUS_{status_name}")
        if b"reward" in fields:
            traj.reward.ParseFromString(fields[b"reward"])
    except (KeyError, ValueError, DecodeError) as exc:
        raise CorruptRecordError(partition, key, repr(exc)) from None
    traj.partition = partition
    tags = traj.tags
    tags.prompt_len = _int(fields, b"prompt_len")
    tags.response_len = _int(fields, b"response_len")
    tags.min_policy_version = _int(fields, b"min_v")
    tags.max_policy_version = _int(fields, b"max_v")
    tags.is_infra = fields.get(b"is_infra") == b"1"
    tags.reward_status = traj.reward.status
    return traj
