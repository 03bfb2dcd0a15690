"""The TransferQueue: Redis-backed, durable record of every prompt group and trajectory.

Two clients with the same operations on the same keys: `TransferQueue` over `redis.Redis` (the
trainer, the CLI, audits) and `AsyncTransferQueue` over `redis.asyncio.Redis` (the gateway and
the reward-service, on their event loops). Each operation is written once, as steps that either
client runs (relayrl.tq.steps, relayrl.tq.runners): the transitions are here, the reads in
relayrl.tq.reads, the event streams in relayrl.tq.events, the key plumbing in relayrl.tq.base.
The state machine and its rules: docs/transferqueue.md.

Every status change is one Lua script: it checks the current status, writes the new one and
appends the transition to the partition's event stream in a single atomic step (see
relayrl.tq.model for the state machine). Puts are idempotent: retrying a put with the same
content is a no-op, reusing a key with other content is a ConflictError.

Key layout (all keys share the hash tag "{<namespace>}", so a Redis Cluster keeps a namespace
on one shard). It is private to relayrl.tq: every other module reads the queue through its
methods (tests/unit/tq/test_tq_key_ownership.py enforces it, and that every key the scripts use
is listed here):
    {ns}:partitions                 set of partition names
    {ns}:p:<part>:g:<uid>           hash: one prompt group (status, step, claim, counters, data)
    {ns}:p:<part>:t:<uid>_<i>       hash: one trajectory's status, tags and reward
    {ns}:p:<part>:td:<uid>_<i>      string: the trajectory's protobuf bytes
    {ns}:p:<part>:stage:<id>:<i>    string: a payload between its SET and the script that
                                    renames it into place, within one MULTI
    {ns}:p:<part>:gs:<status>       sorted set: groups by status, scored by prompt step
                                    (by consumed step for 'consumed')
    {ns}:p:<part>:leases            sorted set: running groups by lease deadline (ms)
    {ns}:p:<part>:launched          groups claimed and not returned to pending
    {ns}:p:<part>:claimseq          counter: the number of the last claim id handed out
    {ns}:p:<part>:tcount            hash: trajectories by status
    {ns}:p:<part>:events            stream: every transition (consumer groups read it)
    {ns}:p:<part>:dead              stream: events given up on after too many deliveries
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self

import redis
import redis.asyncio as aioredis
import redis.asyncio.retry
import redis.retry
from redis.backoff import NoBackoff

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import codec
from relayrl.tq.base import (  # noqa: F401 (the errors' old home)
    DurabilityError,
    TQAuthenticationError,
    TQUnavailableError,
    _positive_int,
)
from relayrl.tq.config import TQConfig
from relayrl.tq.errors import InvalidInputError
from relayrl.tq.events import QueueEvents, event_from_entry  # noqa: F401 (its old home)
from relayrl.tq.model import (
    INFRA_REWARD_STATUSES,
    ClaimedGroup,
    ClaimResult,
    Event,
    GroupStatus,
    NamedClaimResult,
    PartitionSnapshot,
    PutResult,
    TrajectoryPut,
    TrajectoryStatus,
    sources_of,
)
from relayrl.tq.reads import QueueReads
from relayrl.tq.runners import AsyncRunner, SyncRunner
from relayrl.tq.steps import Pipeline, Steps, command, operation

log = logging.getLogger(__name__)


def _claims(claims: Mapping[str, str] | Iterable[ClaimedGroup]) -> list[tuple[str, str]]:
    if isinstance(claims, Mapping):
        pairs = list(claims.items())
    else:
        pairs = [(c.group.uid, c.claim_id) for c in claims]
    for uid, claim_id in pairs:
        codec.check_uid(uid)
        if not isinstance(claim_id, str) or not claim_id:
            raise InvalidInputError(f"claim id of group {uid!r} must be a non-empty string")
    return pairs


def _unique(keys: Iterable[str], what: str) -> list[str]:
    keys = list(keys)
    repeated = [key for key, n in Counter(keys).items() if n > 1]
    if repeated:
        raise InvalidInputError(f"{what} {repeated[0]!r} appears twice in one request")
    return keys


def redis_options(config: TQConfig, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The connection options of `config` for redis-py (sync or asyncio): the password from
    `password_env`, TLS files, timeouts. InvalidInputError for a password variable not set."""
    password = environ.get(config.password_env) if config.password_env else None
    if config.password_env and password is None:
        raise InvalidInputError(f"tq.password_env names {config.password_env!r}, which is not set")
    options: dict[str, Any] = {
        "password": password,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "health_check_interval": config.health_check_interval_s,
    }
    if config.tls is not None:
        options["ssl_ca_certs"] = str(config.tls.ca_file)
        if config.tls.cert_file is not None and config.tls.key_file is not None:
            options["ssl_certfile"] = str(config.tls.cert_file)
            options["ssl_keyfile"] = str(config.tls.key_file)
    return options


def _lease_ms(lease_s: float) -> int:
    return max(1, round(lease_s * 1000))


def _claimed_group(partition: str, fields: Sequence[bytes]) -> ClaimedGroup:
    """A claim as the scripts reply it: uid, claim id, prompt step, data, samples written."""
    uid, claim_id, step, data, have = fields
    group = codec.decode_group(
        partition, uid.decode(), {b"data": data, b"status": b"running", b"step": step}
    )
    present = {int(x) for x in have.split(b",") if x}
    missing = [n for n in range(group.num_samples) if n not in present]
    return ClaimedGroup(group, claim_id.decode(), missing)


class QueueOperations(QueueReads, QueueEvents):
    """Every operation of the TransferQueue, written once (relayrl.tq.steps): the transitions
    here, the reads and the event streams in the classes it extends. TransferQueue and
    AsyncTransferQueue run them.

    Give a client without automatic retries (from_config builds one): a retried claim_groups
    whose first reply was lost would claim a second batch. Puts, scores and consume are
    idempotent, so a caller may retry those itself."""

    @classmethod
    def _from_config(cls, config: TQConfig, client: Any) -> Self:
        return cls(
            client,
            namespace=config.namespace,
            max_value_bytes=config.max_value_bytes,
            event_stream_max_len=config.event_stream_max_len,
            durability=config.durability,
        )

    # -- partitions -----------------------------------------------------------------------

    @operation
    def create_partition(self, partition: str) -> Steps[bool]:
        """Creates a partition; returns False when it already existed."""
        codec.check_partition_name(partition)
        return bool((yield command("sadd", self._partitions_key(), partition)))

    @operation
    def partitions(self) -> Steps[list[str]]:
        members = yield command("smembers", self._partitions_key())
        return sorted(p.decode() for p in members)

    # -- prompt groups --------------------------------------------------------------------

    @operation
    def put_groups(
        self, partition: str, groups: Sequence[common_pb2.PromptGroup | bytes]
    ) -> Steps[PutResult]:
        """Adds prompt groups as pending. Idempotent per uid (same content: no-op)."""
        codec.check_partition_name(partition)
        encoded = [codec.encode_group(g, partition, self._max_value_bytes) for g in groups]
        if not encoded:
            return PutResult([], [])
        argv: list[Any] = [len(encoded)]
        for e in encoded:
            argv += [e.uid, e.prompt_step, e.num_samples, e.digest, e.data]
        flags = yield self._script(partition, "put_groups", *argv)
        return _put_result([e.uid for e in encoded], flags)

    @operation
    def claim_groups(
        self,
        partition: str,
        *,
        max_groups: int,
        claimer: str,
        lease_s: float,
        max_launched: int | None = None,
    ) -> Steps[ClaimResult]:
        """Claims up to `max_groups` pending groups, oldest prompt step first.

        `max_launched` caps the partition-wide count of groups claimed and not yet returned to
        pending, across every claimer: the gateway's staleness throttle passes (v + 1 + eta) * B
        so that concurrent gateways cannot overshoot it together. The claim holds for `lease_s`
        (renew_leases extends it); an expired claim returns the group to pending.
        """
        _positive_int(max_groups, "max_groups", minimum=0)
        cap = self._claim_args(claimer, lease_s, max_launched)
        raw = yield self._script(
            partition, "claim_groups", max_groups, cap, claimer, _lease_ms(lease_s)
        )
        claimed = [_claimed_group(partition, raw[i : i + 5]) for i in range(1, len(raw), 5)]
        return ClaimResult(claimed, int(raw[0]))

    @operation
    def claim_named_groups(
        self,
        partition: str,
        uids: Sequence[str],
        *,
        claimer: str,
        lease_s: float,
        max_launched: int | None = None,
    ) -> Steps[NamedClaimResult]:
        """Claims exactly the named groups that are pending (in the order given, while the
        launched cap allows): what an agent runner handed a group needs, with nothing else
        claimed and given back on the way. The others are reported with the reason."""
        cap = self._claim_args(claimer, lease_s, max_launched)
        names = _unique(uids, "group")
        raw = yield self._script(
            partition, "claim_named", cap, claimer, _lease_ms(lease_s), len(names), *names
        )
        return self._named_claims(partition, raw)

    @operation
    def put_and_claim_groups(
        self,
        partition: str,
        groups: Sequence[common_pb2.PromptGroup],
        *,
        claimer: str,
        lease_s: float,
        max_launched: int | None = None,
    ) -> Steps[NamedClaimResult]:
        """Puts `groups` and claims them in one atomic step (an agent's own groups are never
        pending for another claimer to take). All or nothing: a uid stored with other content
        raises ConflictError and a full launched cap reports every group 'throttled', and
        nothing is written either way. A group already stored with the same content is
        claimed if it is pending, else reported with its status."""
        cap = self._claim_args(claimer, lease_s, max_launched)
        codec.check_partition_name(partition)
        encoded = [codec.encode_group(g, partition, self._max_value_bytes) for g in groups]
        _unique([e.uid for e in encoded], "group")
        argv: list[Any] = [cap, claimer, _lease_ms(lease_s), len(encoded)]
        for e in encoded:
            argv += [e.uid, e.prompt_step, e.num_samples, e.digest, e.data]
        raw = yield self._script(partition, "put_and_claim", *argv)
        return self._named_claims(partition, raw)

    @staticmethod
    def _claim_args(claimer: str, lease_s: float, max_launched: int | None) -> int:
        """Checks a claim's arguments; the launched cap as the scripts take it (-1: none)."""
        if not isinstance(claimer, str) or not claimer:
            raise InvalidInputError("claimer must be a non-empty name (e.g. pod and process id)")
        if not lease_s > 0:
            raise InvalidInputError(f"lease_s must be > 0, got {lease_s!r}")
        return -1 if max_launched is None else _positive_int(max_launched, "max_launched", 0)

    @staticmethod
    def _named_claims(partition: str, raw: list[Any]) -> NamedClaimResult:
        launched, num_claimed = int(raw[0]), int(raw[1])
        claimed = [
            _claimed_group(partition, raw[i : i + 5]) for i in range(2, 2 + 5 * num_claimed, 5)
        ]
        rest = raw[2 + 5 * num_claimed :]
        not_claimed = {rest[i].decode(): rest[i + 1].decode() for i in range(0, len(rest), 2)}
        return NamedClaimResult(claimed, not_claimed, launched)

    @operation
    def renew_leases(
        self, partition: str, claims: Mapping[str, str] | Iterable[ClaimedGroup], lease_s: float
    ) -> Steps[None]:
        """Extends claims; raises StaleClaimError if any was lost (then none is extended)."""
        if not lease_s > 0:
            raise InvalidInputError(f"lease_s must be > 0, got {lease_s!r}")
        pairs = _claims(claims)
        yield self._script(
            partition,
            "renew_leases",
            max(1, round(lease_s * 1000)),
            len(pairs),
            *[x for pair in pairs for x in pair],
        )

    @operation
    def release_groups(
        self,
        partition: str,
        claims: Mapping[str, str] | Iterable[ClaimedGroup],
        reason: str = "released",
    ) -> Steps[int]:
        """Gives claimed groups back to pending (trajectories already written are kept)."""
        return (yield from self._end_claims(partition, claims, GroupStatus.PENDING, reason))

    @operation
    def release_claimer(self, partition: str, claimer: str, reason: str) -> Steps[list[str]]:
        """Gives back every group still claimed under `claimer`'s name (running -> pending,
        trajectories already written kept), whatever its lease: what a claimer that starts
        calls for the claims an earlier process of the same name left when it died, so that
        they are not held until their leases expire. Claimer names must be unique among live
        claimers. Returns the uids."""
        self._claim_args(claimer, 1.0, None)
        return _decoded((yield self._script(partition, "release_claimer", claimer, reason)))

    @operation
    def requeue_expired(self, partition: str, max_groups: int = 1000) -> Steps[list[str]]:
        """Returns groups whose claim lease expired to pending; returns their uids."""
        _positive_int(max_groups, "max_groups")
        return _decoded((yield self._script(partition, "requeue_expired", max_groups)))

    @operation
    def fail_groups(
        self,
        partition: str,
        claims: Mapping[str, str] | Iterable[ClaimedGroup],
        reason: str,
    ) -> Steps[int]:
        """The claimer gives up on whole groups (running -> failed), e.g. every engine is down."""
        return (yield from self._end_claims(partition, claims, GroupStatus.FAILED, reason))

    def _end_claims(
        self,
        partition: str,
        claims: Mapping[str, str] | Iterable[ClaimedGroup],
        target: GroupStatus,
        reason: str,
    ) -> Steps[int]:
        pairs = _claims(claims)
        flat = [x for pair in pairs for x in pair]
        return (
            yield self._script(partition, "end_claims", target.value, reason, len(pairs), *flat)
        )

    @operation
    def reissue_groups(
        self, partition: str, uids: Iterable[str], prompt_step: int | None = None
    ) -> Steps[int]:
        """Failed groups back to pending, optionally re-stamped with the current step."""
        step = -1 if prompt_step is None else _positive_int(prompt_step, "prompt_step", 0)
        moved = self._move(partition, uids, "reissue_groups", GroupStatus.PENDING, "reissued", step)
        return (yield from moved)

    @operation
    def drop_groups(self, partition: str, uids: Iterable[str], reason: str) -> Steps[int]:
        """Evicts finished or scored groups (too stale, no training signal)."""
        return (
            yield from self._move(partition, uids, "drop_groups", GroupStatus.DROPPED, reason, -1)
        )

    def _move(
        self,
        partition: str,
        uids: Iterable[str],
        operation: str,
        target: GroupStatus,
        reason: str,
        step: int,
    ) -> Steps[int]:
        keys = _unique((codec.check_uid(u) for u in uids), "group")
        sources = ",".join(sources_of(operation))
        return (
            yield self._script(
                partition, "move_groups", target.value, sources, reason, step, len(keys), *keys
            )
        )

    # -- trajectories ---------------------------------------------------------------------

    @operation
    def put_trajectories(self, partition: str, puts: Sequence[TrajectoryPut]) -> Steps[PutResult]:
        """Writes trajectories under their group's claim. A group whose every sample is written
        becomes finished (and scored at once if every sample failed). Idempotent per key."""
        codec.check_partition_name(partition)
        argv: list[Any] = []
        encoded = []
        for put in puts:
            if not isinstance(put, TrajectoryPut):
                raise InvalidInputError(
                    f"put_trajectories takes TrajectoryPut items, not {type(put).__name__}"
                )
            e = codec.encode_trajectory(put.trajectory, partition, self._max_value_bytes)
            status = TrajectoryStatus.FAILED if put.failed else TrajectoryStatus.FINISHED
            argv += [
                e.uid,
                e.index,
                e.key,
                put.claim_id,
                status.value,
                e.digest,
                e.prompt_len,
                e.response_len,
                e.min_policy_version,
                e.max_policy_version,
            ]
            encoded.append(e)
        if not encoded:
            return PutResult([], [])
        # Payloads go in as plain SETs under staging keys, in one MULTI with the script that
        # renames them into place: bulk bytes never pass through Lua, and a client that dies
        # before EXEC leaves nothing behind.
        stage = f"{self._key_prefix(partition)}stage:{uuid.uuid4().hex}:"
        flags = yield Pipeline(
            [command("set", f"{stage}{i}", e.data) for i, e in enumerate(encoded)],
            transaction=True,
            then=self._script(partition, "put_trajectories", stage, len(encoded), *argv),
        )
        return _put_result([e.key for e in encoded], flags)

    @operation
    def score_trajectories(
        self,
        partition: str,
        rewards: Mapping[str, common_pb2.RewardResult | bytes],
    ) -> Steps[list[str]]:
        """Attaches rewards to finished trajectories (key -> result). The first score of a key
        stands: scoring it again is a no-op, so a redelivered event cannot score twice.
        Returns the keys scored by this call."""
        argv: list[Any] = [len(rewards)]
        keys = list(rewards)
        for key in keys:
            codec.split_trajectory_key(key)
            data, status = codec.encode_reward(rewards[key], key, self._max_value_bytes)
            argv += [key, int(status), int(status in INFRA_REWARD_STATUSES), data]
        if not keys:
            return []
        flags = yield self._script(partition, "score_trajectories", *argv)
        return [key for key, flag in zip(keys, flags, strict=True) if flag]

    # -- trainer side ---------------------------------------------------------------------

    @operation
    def consume(self, partition: str, step: int, num_groups: int) -> Steps[list[str]]:
        """Marks up to `num_groups` scored groups (oldest prompt step first) consumed at `step`
        and returns every group consumed at `step`. Calling it again for the same step returns
        the same groups (topped up to `num_groups`): a retried step never takes new data."""
        _positive_int(step, "step", 0)
        _positive_int(num_groups, "num_groups", 0)
        return _decoded((yield self._script(partition, "consume", step, num_groups)))

    @operation
    def reset_consumption(self, partition: str, after_step: int) -> Steps[list[str]]:
        """After restoring the checkpoint of `after_step`: groups consumed at later steps go back
        to scored, so resuming neither loses nor re-trains a trajectory. -1: a trainer that
        starts over without a checkpoint gives back every consumed group."""
        if not isinstance(after_step, int) or isinstance(after_step, bool) or after_step < -1:
            raise InvalidInputError(f"after_step must be an integer >= -1, got {after_step!r}")
        return _decoded((yield self._script(partition, "reset_consumption", after_step)))

    # -- inspection ---------------------------------------------------------------------------

    @operation
    def audit_snapshot(self, partition: str, page: int = 10_000) -> Steps[PartitionSnapshot]:
        """Every group with its trajectories, the leases, the whole event stream and the
        consumer groups of a partition: what an audit of a stopped run reads (`relayrl audit`).
        Not one atomic step, and as big as the partition: not for a running system's hot path."""
        uids = yield from self.group_uids.steps(partition)
        groups = {}
        if uids:
            groups = {g.group.uid: g for g in (yield from self.get_groups.steps(partition, uids))}
        events: list[Event] = []
        start = "-"
        while True:
            batch = yield from self.read_events.steps(partition, start, page)
            events += batch
            if len(batch) < page:
                break
            start = "(" + batch[-1].id
        return PartitionSnapshot(
            groups=groups,
            leases=(yield from self.leases.steps(partition)),
            events=events,
            consumer_groups=(yield from self.consumer_groups.steps(partition, page)),
        )

    @operation
    def check_durability(self) -> Steps[None]:
        """Raises DurabilityError unless the server runs with AOF and the configured fsync policy.
        A server that hides CONFIG (managed Redis) gets a warning instead; so does every server
        with `durability: off`."""
        if self._durability == "off":
            log.warning(
                "tq.durability is off: a restart of Redis %s may lose the whole queue",
                self._redis.connection_pool.connection_kwargs.get("host", ""),
            )
            return
        try:
            config = yield command("config_get", "append*")
        except redis.ResponseError as exc:
            log.warning("cannot read the Redis config to check durability (%s)", exc)
            return
        appendonly = config.get(b"appendonly", config.get("appendonly"))
        fsync = config.get(b"appendfsync", config.get("appendfsync"))
        appendonly = appendonly.decode() if isinstance(appendonly, bytes) else appendonly
        fsync = fsync.decode() if isinstance(fsync, bytes) else fsync
        if appendonly != "yes" or fsync != self._durability:
            raise DurabilityError(
                f"Redis runs with appendonly={appendonly} appendfsync={fsync}, but the "
                f"TransferQueue expects appendonly=yes appendfsync={self._durability}: "
                "configure the server (or set tq.durability to match)"
            )


def _decoded(uids: list[bytes]) -> list[str]:
    return [u.decode() for u in uids]


def _put_result(keys: list[str], flags: list[int]) -> PutResult:
    created = [k for k, f in zip(keys, flags, strict=True) if f]
    duplicates = [k for k, f in zip(keys, flags, strict=True) if not f]
    return PutResult(created, duplicates)


class TransferQueue(QueueOperations):
    """Client of the TransferQueue over `redis.Redis`: every operation returns its result.
    Thread-safe (one Redis connection pool); the trainer, the CLI and audits use it. Services
    on asyncio use AsyncTransferQueue, which has the same operations."""

    _runner_type = SyncRunner
    _runner: SyncRunner
    _redis: redis.Redis

    @classmethod
    def from_config(cls, config: TQConfig) -> TransferQueue:
        """A client with the config's options, no automatic retries (see QueueOperations),
        and the config's partitions created."""
        # No automatic retries: claim_groups is not idempotent, and callers decide.
        no_retries = redis.retry.Retry(NoBackoff(), 0)
        client = redis.Redis.from_url(config.url, **redis_options(config), retry=no_retries)
        tq = cls._from_config(config, client)
        for partition in config.partitions:
            tq.create_partition(partition)
        return tq

    @property
    def redis(self) -> redis.Redis:
        return self._redis

    def close(self) -> None:
        self._redis.close()


class AsyncTransferQueue(QueueOperations):
    """Client of the TransferQueue over `redis.asyncio.Redis`, for the services on asyncio
    (gateway, reward-service): every operation is a coroutine, the same operations as
    TransferQueue's, on the same keys. Use it from one event loop; `aclose` it there."""

    _runner_type = AsyncRunner
    _runner: AsyncRunner
    _redis: aioredis.Redis

    @classmethod
    def from_config(cls, config: TQConfig) -> AsyncTransferQueue:
        """A client with the config's options and no automatic retries, as
        TransferQueue.from_config builds, without I/O: a service creates its partitions once
        Redis answers (`await create_partition`), so `config.partitions` must be empty."""
        if config.partitions:
            raise InvalidInputError(
                "AsyncTransferQueue.from_config does no I/O and creates no partitions: pass "
                "partitions=[] and await create_partition for each"
            )
        # Bounded: each task of the service takes a connection per command, and a gateway
        # with thousands of rollouts in flight would otherwise open thousands.
        pool = aioredis.BlockingConnectionPool.from_url(
            config.url,
            **redis_options(config),
            retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
            max_connections=config.max_connections,
            timeout=config.socket_timeout_s,
        )
        client = aioredis.Redis(connection_pool=pool)
        client.auto_close_connection_pool = True  # aclose() closes its connections too
        return cls._from_config(config, client)

    @property
    def redis(self) -> aioredis.Redis:
        return self._redis

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
