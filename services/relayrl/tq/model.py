"""The TransferQueue's data model: statuses, the legal transitions, and the records it returns.

Prompt groups move through
    pending -> running -> finished | failed;  finished -> scored -> consumed(step)
with the ways back that crash recovery needs (running -> pending when a claim is released or its
lease expires, failed -> pending when a group is reissued, consumed -> scored when a trainer
restores an older checkpoint) and an exit for groups the trainer evicts (-> dropped).
Trajectories move finished -> scored; a trajectory put as failed (an infrastructure failure
during rollout) is terminal and is never scored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from relayrl.proto.common.v1 import common_pb2


class GroupStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    SCORED = "scored"
    CONSUMED = "consumed"
    DROPPED = "dropped"

    def to_proto(self) -> common_pb2.GroupStatus:
        return common_pb2.GroupStatus.Value(f"GROUP_STATUS_{self.name}")


class TrajectoryStatus(enum.StrEnum):
    FINISHED = "finished"
    FAILED = "failed"
    SCORED = "scored"

    def to_proto(self) -> common_pb2.TrajectoryStatus:
        return common_pb2.TrajectoryStatus.Value(f"TRAJECTORY_STATUS_{self.name}")


G, T = GroupStatus, TrajectoryStatus

# Every legal group transition, with the TransferQueue methods that perform it. `None` is "the
# key does not exist yet". The Lua scripts enforce exactly this table: operations that start
# from a set of statuses receive it from `sources_of`.
GROUP_TRANSITIONS: dict[tuple[GroupStatus | None, GroupStatus], tuple[str, ...]] = {
    (None, G.PENDING): ("put_groups",),
    (G.PENDING, G.RUNNING): ("claim_groups",),
    (G.RUNNING, G.PENDING): ("release_groups", "requeue_expired", "release_claimer"),
    (G.RUNNING, G.FINISHED): ("put_trajectories",),  # with the group's last sample
    (G.RUNNING, G.FAILED): ("fail_groups",),
    (G.FAILED, G.PENDING): ("reissue_groups",),
    # when the last sample settles (is scored, or was put as failed)
    (G.FINISHED, G.SCORED): ("score_trajectories", "put_trajectories"),
    (G.SCORED, G.CONSUMED): ("consume",),
    (G.CONSUMED, G.SCORED): ("reset_consumption",),
    (G.FINISHED, G.DROPPED): ("drop_groups",),
    (G.SCORED, G.DROPPED): ("drop_groups",),
}

TRAJECTORY_TRANSITIONS: dict[tuple[TrajectoryStatus | None, TrajectoryStatus], tuple[str, ...]] = {
    (None, T.FINISHED): ("put_trajectories",),
    (None, T.FAILED): ("put_trajectories",),  # TrajectoryPut(failed=True)
    (T.FINISHED, T.SCORED): ("score_trajectories",),
}


def sources_of(operation: str) -> list[GroupStatus]:
    """Statuses a group may be in for `operation` (a TransferQueue method name)."""
    return [
        src
        for (src, _), operations in GROUP_TRANSITIONS.items()
        if operation in operations and src is not None
    ]


# Reward statuses that mean "the scorer's infrastructure failed", not "the policy failed".
INFRA_REWARD_STATUSES = frozenset(
    {
        common_pb2.REWARD_STATUS_INFRA_ERROR,
        common_pb2.REWARD_STATUS_TIMEOUT,
        common_pb2.REWARD_STATUS_RATE_LIMITED,
    }
)


@dataclass(frozen=True)
class ClaimedGroup:
    """A prompt group the caller now owns until its lease expires or it releases it."""

    group: common_pb2.PromptGroup
    claim_id: str
    # Sample indices that still need a trajectory (a group requeued after a crash keeps the
    # trajectories its previous claimer already wrote).
    missing_indices: list[int]


@dataclass(frozen=True)
class TrajectoryPut:
    """One trajectory to write, under the claim of its group."""

    trajectory: common_pb2.Trajectory | bytes
    claim_id: str
    # An infrastructure failure during rollout: stored as failed, is_infra, never scored.
    failed: bool = False


@dataclass(frozen=True)
class ClaimResult:
    claimed: list[ClaimedGroup]
    # Groups claimed and not returned to pending, across every claimer, after this call.
    num_launched: int


@dataclass(frozen=True)
class NamedClaimResult:
    """What claiming named groups (or putting and claiming them) did."""

    claimed: list[ClaimedGroup]
    # uid -> why it was not claimed: its status (running, consumed, ...), 'unknown' or
    # 'throttled' (the launched cap is reached; put_and_claim then wrote nothing).
    not_claimed: dict[str, str]
    num_launched: int


@dataclass(frozen=True)
class GroupWithTrajectories:
    group: common_pb2.PromptGroup
    trajectories: list[common_pb2.Trajectory]


@dataclass(frozen=True)
class PutResult:
    # Keys written by this call; the others were already there with identical content.
    created: list[str]
    duplicates: list[str]


@dataclass(frozen=True)
class Counts:
    groups: dict[GroupStatus, int]
    trajectories: dict[TrajectoryStatus, int]
    num_launched: int


@dataclass(frozen=True)
class Event:
    """One status transition, as read from a partition's event stream."""

    id: str
    kind: str  # "group" or "trajectory"
    key: str
    from_status: str  # "" for a key that did not exist before
    to_status: str
    # Delivery attempts so far (1 on first delivery).
    deliveries: int = 1
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Lease:
    """A running group's claim: who holds it and until when (ms since the epoch)."""

    uid: str
    claim_id: str
    claimer: str
    deadline_ms: int


@dataclass(frozen=True)
class PendingEntry:
    """An event delivered to a reader of a consumer group and not acknowledged yet."""

    id: str
    reader: str
    deliveries: int


@dataclass(frozen=True)
class ConsumerGroupState:
    """Where one consumer group of a partition's event stream stands."""

    name: str
    # The last event delivered to any of its readers ("0-0": none yet); later events are still
    # to be delivered.
    last_delivered_id: str
    pending: list[PendingEntry]  # oldest first


@dataclass(frozen=True)
class PartitionSnapshot:
    """Everything one partition holds, read in one pass for an audit of a stopped run (the
    reads are not one atomic step: a running system may move on between them)."""

    groups: dict[str, GroupWithTrajectories]  # by uid, in uid order
    leases: list[Lease]  # earliest deadline first
    events: list[Event]  # the whole event stream, oldest first
    consumer_groups: dict[str, ConsumerGroupState]  # by name
