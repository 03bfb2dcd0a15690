"""Reading the TransferQueue: groups, trajectories, counts and staleness (no transitions)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import codec
from relayrl.tq.base import QueueBase, unavailable_as_tq_error
from relayrl.tq.errors import InvalidInputError, UnknownKeyError
from relayrl.tq.model import Counts, GroupStatus, GroupWithTrajectories, Lease, TrajectoryStatus


class QueueReads(QueueBase):
    """What a partition holds, read with pipelined commands (never a transition)."""

    def get_groups(
        self, partition: str, uids: Sequence[str], *, with_trajectories: bool = True
    ) -> list[GroupWithTrajectories]:
        """Reads groups (with tags) and, optionally, their written trajectories (in index order).
        Raises UnknownKeyError for a missing group."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        pipe = self._redis.pipeline(transaction=False)
        for uid in uids:
            pipe.hgetall(f"{prefix}g:{codec.check_uid(uid)}")
        group_fields = self._pipeline_execute(pipe)
        groups = []
        for uid, fields in zip(uids, group_fields, strict=True):
            if not fields:
                raise UnknownKeyError(partition, uid)
            groups.append(codec.decode_group(partition, uid, fields))
        trajectories: list[list[common_pb2.Trajectory]] = [[] for _ in groups]
        if with_trajectories:
            wanted = [(n, g.uid, i) for n, g in enumerate(groups) for i in range(g.num_samples)]
            pipe = self._redis.pipeline(transaction=False)
            for _, uid, i in wanted:
                pipe.hgetall(f"{prefix}t:{codec.trajectory_key(uid, i)}")
                pipe.get(f"{prefix}td:{codec.trajectory_key(uid, i)}")
            replies = self._pipeline_execute(pipe)
            for (n, uid, i), fields, data in zip(wanted, replies[::2], replies[1::2], strict=True):
                if fields:
                    key = codec.trajectory_key(uid, i)
                    trajectories[n].append(codec.decode_trajectory(partition, key, fields, data))
        return [GroupWithTrajectories(g, t) for g, t in zip(groups, trajectories, strict=True)]

    def groups_exist(self, partition: str, uids: Sequence[str]) -> list[bool]:
        """Whether each uid names a group in the partition (in any status)."""
        prefix = self._key_prefix(codec.check_partition_name(partition))
        pipe = self._redis.pipeline(transaction=False)
        for uid in uids:
            pipe.exists(f"{prefix}g:{codec.check_uid(uid)}")
        return [bool(n) for n in self._pipeline_execute(pipe)]

    def group_uids(self, partition: str, status: GroupStatus | None = None) -> list[str]:
        """The uids of every group of the partition (a SCAN: meant for audits and tests, not for
        a hot path), or of those in `status` (its index), sorted."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        with unavailable_as_tq_error():
            if status is not None:
                members = self._redis.zrange(f"{prefix}gs:{GroupStatus(status).value}", 0, -1)
                return sorted(uid.decode() for uid in members)
            found = self._redis.scan_iter(f"{prefix}g:*", count=1000)
            return sorted(key.decode()[len(prefix) + 2 :] for key in found)

    def leases(self, partition: str) -> list[Lease]:
        """The claims of the running groups, earliest deadline first (one atomic read)."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        raw = self._run(partition, "leases", [f"{prefix}leases"], [prefix])
        return [
            Lease(uid.decode(), claim.decode(), claimer.decode(), int(float(deadline)))
            for uid, deadline, claim, claimer in zip(*[iter(raw)] * 4, strict=True)
        ]

    def get_trajectories(self, partition: str, keys: Sequence[str]) -> list[common_pb2.Trajectory]:
        """Reads trajectories by key; raises UnknownKeyError for a missing one."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            codec.split_trajectory_key(key)
            pipe.hgetall(f"{prefix}t:{key}")
            pipe.get(f"{prefix}td:{key}")
        out = []
        replies = self._pipeline_execute(pipe)
        for key, fields, data in zip(keys, replies[::2], replies[1::2], strict=True):
            if not fields:
                raise UnknownKeyError(partition, key)
            out.append(codec.decode_trajectory(partition, key, fields, data))
        return out

    def counts(self, partition: str) -> Counts:
        """Groups by status, trajectories by status, and the launched counter (for metrics)."""
        codec.check_partition_name(partition)
        prefix = self._key_prefix(partition)
        pipe = self._redis.pipeline(transaction=False)
        for status in GroupStatus:
            pipe.zcard(f"{prefix}gs:{status.value}")
        pipe.hgetall(f"{prefix}tcount")
        pipe.get(f"{prefix}launched")
        *group_counts, traj_counts, launched = self._pipeline_execute(pipe)
        return Counts(
            groups=dict(zip(GroupStatus, group_counts, strict=True)),
            trajectories={s: int(traj_counts.get(s.value.encode(), 0)) for s in TrajectoryStatus},
            num_launched=int(launched or 0),
        )

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
    ) -> dict[GroupStatus, dict[int, int]]:
        """Histogram of staleness (step - prompt_step + 1) of the groups in each status."""
        codec.check_partition_name(partition)
        statuses = list(statuses)
        if GroupStatus.CONSUMED in statuses:
            raise InvalidInputError("consumed groups have no staleness at `step`; leave them out")
        prefix = self._key_prefix(partition)
        pipe = self._redis.pipeline(transaction=False)
        for status in statuses:
            pipe.zrange(f"{prefix}gs:{status.value}", 0, -1, withscores=True)
        out = {}
        for status, members in zip(statuses, self._pipeline_execute(pipe), strict=True):
            out[status] = dict(sorted(Counter(step - int(s) + 1 for _, s in members).items()))
        return out

    def groups_issued_by(
        self, partition: str, statuses: Iterable[GroupStatus], max_prompt_step: int
    ) -> dict[GroupStatus, list[str]]:
        """Uids of the groups in each status whose prompt_step is <= `max_prompt_step` (the
        trainer's staleness gate: staleness > t at step s <=> prompt_step <= s - t)."""
        codec.check_partition_name(partition)
        statuses = list(statuses)
        prefix = self._key_prefix(partition)
        pipe = self._redis.pipeline(transaction=False)
        for status in statuses:
            pipe.zrangebyscore(f"{prefix}gs:{GroupStatus(status).value}", "-inf", max_prompt_step)
        replies = self._pipeline_execute(pipe)
        return {
            GroupStatus(s): [u.decode() for u in uids]
            for s, uids in zip(statuses, replies, strict=True)
        }
