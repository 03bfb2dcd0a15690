"""Reading the TransferQueue: groups, trajectories, counts and staleness (no transitions)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import codec
from relayrl.tq.base import QueueBase
from relayrl.tq.errors import InvalidInputError, UnknownKeyError
from relayrl.tq.model import Counts, GroupStatus, GroupWithTrajectories, Lease, TrajectoryStatus
from relayrl.tq.steps import Pipeline, Script, Steps, command, operation

READ_CHUNK = 256
"""Trajectories read by one read_trajectories script."""


class QueueReads(QueueBase):
    """What a partition holds, read with pipelined commands (never a transition)."""

    @operation
    def get_groups(
        self, partition: str, uids: Sequence[str], *, with_trajectories: bool = True
    ) -> Steps[list[GroupWithTrajectories]]:
        """Reads groups (with tags) and, optionally, their written trajectories (in index order).
        Raises UnknownKeyError for a missing group."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        group_fields = yield Pipeline(
            [command("hgetall", f"{prefix}g:{codec.check_uid(uid)}") for uid in uids]
        )
        groups = []
        for uid, fields in zip(uids, group_fields, strict=True):
            if not fields:
                raise UnknownKeyError(partition, uid)
            groups.append(codec.decode_group(partition, uid, fields))
        trajectories: list[list[common_pb2.Trajectory]] = [[] for _ in groups]
        if with_trajectories:
            wanted = [
                (n, codec.trajectory_key(g.uid, i))
                for n, g in enumerate(groups)
                for i in range(g.num_samples)
            ]
            read = yield from self._read_trajectories(partition, [key for _, key in wanted])
            for (n, key), (fields, data) in zip(wanted, read, strict=True):
                if fields:
                    trajectories[n].append(codec.decode_trajectory(partition, key, fields, data))
        return [GroupWithTrajectories(g, t) for g, t in zip(groups, trajectories, strict=True)]

    def _read_trajectories(
        self, partition: str, keys: Sequence[str]
    ) -> Steps[list[tuple[dict[bytes, bytes], bytes | None]]]:
        """Each trajectory's tags (empty: no such trajectory) and bytes, READ_CHUNK at a time
        by one script each: one command where a pipeline sends two per trajectory, and never
        one long script that holds Redis up (an audit reads every trajectory of a run)."""
        prefix = self._key_prefix(partition)
        out: list[tuple[dict[bytes, bytes], bytes | None]] = []
        for start in range(0, len(keys), READ_CHUNK):
            chunk = keys[start : start + READ_CHUNK]
            names = [name for key in chunk for name in (f"{prefix}t:{key}", f"{prefix}td:{key}")]
            out += _tags_and_bytes((yield Script(partition, "read_trajectories", names, [])))
        return out

    @operation
    def groups_exist(self, partition: str, uids: Sequence[str]) -> Steps[list[bool]]:
        """Whether each uid names a group in the partition (in any status)."""
        prefix = self._key_prefix(codec.check_partition_name(partition))
        found = yield Pipeline([command("exists", f"{prefix}g:{codec.check_uid(u)}") for u in uids])
        return [bool(n) for n in found]

    @operation
    def group_uids(self, partition: str, status: GroupStatus | None = None) -> Steps[list[str]]:
        """The uids of every group of the partition (a SCAN: meant for audits and tests, not for
        a hot path), or of those in `status` (its index), sorted."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        if status is not None:
            members = yield command("zrange", f"{prefix}gs:{GroupStatus(status).value}", 0, -1)
            return sorted(uid.decode() for uid in members)
        found: list[bytes] = []
        cursor = 0
        while True:
            cursor, keys = yield command("scan", cursor, match=f"{prefix}g:*", count=1000)
            found += keys
            if cursor == 0:
                return sorted({key.decode()[len(prefix) + 2 :] for key in found})

    @operation
    def leases(self, partition: str) -> Steps[list[Lease]]:
        """The claims of the running groups, earliest deadline first (one atomic read)."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        raw = yield Script(partition, "leases", [f"{prefix}leases"], [prefix])
        return [
            Lease(uid.decode(), claim.decode(), claimer.decode(), int(float(deadline)))
            for uid, deadline, claim, claimer in zip(*[iter(raw)] * 4, strict=True)
        ]

    @operation
    def get_trajectories(
        self, partition: str, keys: Sequence[str]
    ) -> Steps[list[common_pb2.Trajectory]]:
        """Reads trajectories by key; raises UnknownKeyError for a missing one."""
        codec.check_partition_name(partition)
        for key in keys:
            codec.split_trajectory_key(key)
        read = yield from self._read_trajectories(partition, keys)
        out = []
        for key, (fields, data) in zip(keys, read, strict=True):
            if not fields:
                raise UnknownKeyError(partition, key)
            out.append(codec.decode_trajectory(partition, key, fields, data))
        return out

    @operation
    def counts(self, partition: str) -> Steps[Counts]:
        """Groups by status, trajectories by status, and the launched counter (for metrics)."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        *group_counts, traj_counts, launched = yield Pipeline(
            [
                *(command("zcard", f"{prefix}gs:{status.value}") for status in GroupStatus),
                command("hgetall", f"{prefix}tcount"),
                command("get", f"{prefix}launched"),
            ]
        )
        return Counts(
            groups=dict(zip(GroupStatus, group_counts, strict=True)),
            trajectories={s: int(traj_counts.get(s.value.encode(), 0)) for s in TrajectoryStatus},
            num_launched=int(launched or 0),
        )

    @operation
    def staleness(
        self,
        partition: str,
        step: int,
        statuses: Iterable[GroupStatus] = (
            GroupStatus.PENDING,
            GroupStatus.RUNNING,
            GroupStatus.FINISHED,
            GroupStatus.SCORED,
        ),
    ) -> Steps[dict[GroupStatus, dict[int, int]]]:
        """Histogram of staleness (step - prompt_step + 1) of the groups in each status."""
        codec.check_partition_name(partition)
        statuses = list(statuses)
        if GroupStatus.CONSUMED in statuses:
            raise InvalidInputError("consumed groups have no staleness at `step`; leave them out")
        prefix = self._key_prefix(partition)
        replies = yield Pipeline(
            [command("zrange", f"{prefix}gs:{s.value}", 0, -1, withscores=True) for s in statuses]
        )
        out = {}
        for status, members in zip(statuses, replies, strict=True):
            out[status] = dict(sorted(Counter(step - int(s) + 1 for _, s in members).items()))
        return out

    @operation
    def groups_issued_by(
        self, partition: str, statuses: Iterable[GroupStatus], max_prompt_step: int
    ) -> Steps[dict[GroupStatus, list[str]]]:
        """Uids of the groups in each status whose prompt_step is <= `max_prompt_step` (the
        trainer's staleness gate: staleness > t at step s <=> prompt_step <= s - t)."""
        codec.check_partition_name(partition)
        statuses = list(statuses)
        prefix = self._key_prefix(partition)
        replies = yield Pipeline(
            [
                command(
                    "zrangebyscore", f"{prefix}gs:{GroupStatus(s).value}", "-inf", max_prompt_step
                )
                for s in statuses
            ]
        )
        return {
            GroupStatus(s): [u.decode() for u in uids]
            for s, uids in zip(statuses, replies, strict=True)
        }


def _tags_and_bytes(reply: list[Any]) -> Iterator[tuple[dict[bytes, bytes], bytes | None]]:
    """The read_trajectories script's reply: each trajectory's tags (as HGETALL gives them to
    a client: a dict) and its bytes."""
    for flat, data in zip(reply[::2], reply[1::2], strict=True):
        yield dict(zip(flat[::2], flat[1::2], strict=True)), data
