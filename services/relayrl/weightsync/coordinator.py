"""The weight-sync service's logic: transfers, the version switch, commit, late joiners.

A version moves through the five boundaries of docs/recovery.md (and DESIGN's weight-sync
section), each with its own metric and error:

    export     trainer ranks export HF-named tensors (bf16, or FP8 + scales) -- sender side
    transport  senders push buckets (checksummed) to this service, which keeps them in host
               memory
    switch     the gateway pauses the replicas (abort | keep | wait)
    load       the buckets go to every worker of every live replica over the configured data
               plane -- each worker pulls them over gRPC, or this service broadcasts them
               (torch_distributed) or writes them (mooncake) to all workers at once -- and the
               worker extension checks each bucket's sha256 and loads the tensors through
               vLLM's load path
    restore    the version is committed (written to `state_dir` first), then the replicas
               that loaded it get their prefix cache reset, the version label and are resumed

Replicas. Each one has the id the gateway gives it (a pod name, or engine-<index> for a
configured URL list: relayrl.core.replicas). The gateway registers every healthy replica
every few seconds; a registration is also a reconciliation: under the switch lock, the
replica's workers are asked which weights they hold whole (`relayrl_ping`), and a replica
that does not hold the committed transfer is loaded with it before the gateway may route to
it (ResumeReplicas with the committed version is the only way a replica enters routing). A
new engine, a restarted one, one that failed a load half-way and one that a restarted gateway
finds all go through the same path.

Commit. A version commits when every live replica has loaded it, or has spent its attempts
(with a backoff that gives a restarting engine time to come back) and is then left out of
routing until a reconciliation loads it. The exception is a version that every replica that
answered refused: it fails, and the previous version stays committed. The committed version
stays in host memory and in `state_dir`, so that late joiners get it without the trainer,
also after a restart of this service.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.core.replicas import static_replica_ids
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.transfer.plan import BucketLayout, Piece, TensorSpec, plan_buckets, plan_digest
from relayrl.transfer.transports.base import TransportSpec
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.state import CommittedStore, StoredVersion

TRANSPORT_TYPES = {
    "grpc": pb.TRANSPORT_TYPE_GRPC,
    "torch_distributed": pb.TRANSPORT_TYPE_TORCH_DISTRIBUTED,
    "mooncake": pb.TRANSPORT_TYPE_MOONCAKE,
}

logger = logging.getLogger(__name__)

_PING_TIMEOUT_S = 10.0
_ANSWER_AFTER_FAILURE_S = 10.0
_MAX_RECONCILE_BACKOFF_S = 30.0

INITIAL_WEIGHTS = ""
"""What a worker holds before any load (relayrl.engine.worker_extension): the weights it
started from, which are the trainer's version 0."""
LOADED, REFUSED, UNREACHABLE = "loaded", "refused", "unreachable"
"""How a replica ended a version: it holds it; it answers but could not load it; it is gone."""


def loading_label(version: int) -> str:
    """The engine's weight-version label while a version loads: not a version, so nothing
    that reads the label (spans, evaluation, an operator) takes a half-loaded model for one."""
    return f"loading-{version}"


class SyncError(Exception):
    """A failure at one boundary; `boundary` names it (export, transport, switch, load,
    restore) so that an operator knows where to look."""

    def __init__(self, boundary: str, message: str) -> None:
        super().__init__(f"{boundary}: {message}")
        self.boundary = boundary


class PlanMismatch(ValueError):
    """A sender's manifest or a receiver's plan differs from the transfer's."""


def tensor_spec(meta: common_pb2.TensorMeta) -> TensorSpec:
    """A sender's manifest entry as the planner sees it (ValueError says what is wrong)."""
    if not meta.name:
        raise ValueError("every tensor needs a name")
    if any(d < 0 for d in meta.shape):
        raise ValueError(f"tensor {meta.name!r}: negative dimension in {list(meta.shape)}")
    piece = Piece.from_proto(meta)  # checks dtype and quantization
    return TensorSpec(
        meta.name, tuple(meta.shape), piece.dtype, piece.quantization, piece.scale_name
    )


def manifest_digest(metas: Sequence[common_pb2.TensorMeta]) -> str:
    digest = hashlib.sha256()
    for m in metas:
        digest.update(
            f"{m.name}|{list(m.shape)}|{m.dtype}|{m.quantization}|{m.scale_name};".encode()
        )
    return digest.hexdigest()


@dataclass
class Transfer:
    transfer_id: str
    version: int
    trainer_step: int
    metas: list[common_pb2.TensorMeta]
    manifest: str
    layouts: list[BucketLayout]
    plan_digest: str
    buckets: list[bytes | None]
    sha256: list[str]
    state: int = pb.TRANSFER_STATE_PLANNED
    error: str = ""
    replica_ids: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    # Seconds per boundary of this transfer (load and restore: the slowest replica).
    durations_s: dict[str, float] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_bytes(self) -> int:
        return sum(b.size_bytes for b in self.layouts)

    def plan_proto(self, bucket_size_bytes: int, transport: str) -> pb.BucketPlan:
        """The plan as senders and receivers see it; `transport` is the data plane from this
        service to the engines (senders always push over gRPC)."""
        buckets = []
        for layout in self.layouts:
            buckets.append(
                pb.Bucket(
                    index=layout.index,
                    size_bytes=layout.size_bytes,
                    tensors=[piece.to_proto() for piece in layout.pieces],
                )
            )
        return pb.BucketPlan(
            transfer_id=self.transfer_id,
            version=self.version,
            bucket_size_bytes=bucket_size_bytes,
            transport=TRANSPORT_TYPES[transport],
            buckets=buckets,
            replica_ids=self.replica_ids,
            state=self.state,
            error=self.error,
        )


@dataclass
class EngineEntry:
    """One replica as weight-sync knows it."""

    replica_id: str
    url: str
    source: str = "config"  # or "registered" (by the gateway, or anyone, over gRPC)
    version: int = 0  # the version it last held whole
    # The transfer it holds whole ("": its initial weights); None: unknown, or a half-loaded mix
    holds: str | None = None
    # It spent its attempts on a version: out of switches until a reconciliation loads it.
    failed: bool = False
    last_error: str = ""
    registered_at: float = field(default_factory=time.monotonic)
    routed: bool = False  # the gateway routes to it (as of its last registration)
    reconciling: bool = False
    num_failed_reconciles: int = 0
    reconcile_after: float = 0.0

    def live(self, now: float, ttl_s: float) -> bool:
        """Whether a version switch includes it."""
        if self.failed:
            return False
        return self.source == "config" or now - self.registered_at <= ttl_s


# The engine-side calls the coordinator makes; `VllmEngineClient` in production, anything with
# these coroutines in a test of the logic.
EngineFactory = Callable[[str, float], Any]


class Coordinator:
    def __init__(
        self,
        config: WeightSyncConfig,
        metrics: WeightSyncMetrics,
        *,
        engine_factory: EngineFactory,
        gateway: Any = None,
        advertise_target: Callable[[], str],
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._engine_factory = engine_factory
        self._gateway = gateway
        self._advertise_target = advertise_target
        self.engines: dict[str, EngineEntry] = {}
        self.transfers: dict[str, Transfer] = {}
        self.by_version: dict[int, Transfer] = {}
        self.committed: Transfer | None = None
        self._store = CommittedStore(config.state_dir) if config.state_dir else None
        self._switch_lock = asyncio.Lock()
        self._mooncake: Any = None  # the Mooncake engine, started on first use
        self._tasks: set[asyncio.Task[Any]] = set()
        for replica_id, url in static_replica_ids(config.engines.urls).items():
            self.engines[replica_id] = EngineEntry(replica_id, url)
        if self._store is not None:
            stored = self._store.load()  # StateError (one line) when unusable
            if stored is not None:
                self._restore(stored)
        else:
            logger.warning(
                "no state_dir: the committed version lives in memory only, and a restarted "
                "weight-sync cannot bring new engines to it until the trainer publishes again"
            )

    def _restore(self, stored: StoredVersion) -> None:
        transfer = Transfer(
            transfer_id=stored.transfer_id,
            version=stored.version,
            trainer_step=stored.trainer_step,
            metas=stored.metas,
            manifest=manifest_digest(stored.metas),
            layouts=stored.layouts,
            plan_digest=stored.plan_digest,
            buckets=list(stored.buckets),
            sha256=stored.sha256,
            state=pb.TRANSFER_STATE_COMMITTED,
        )
        transfer.complete.set()
        transfer.done.set()
        self.transfers[transfer.transfer_id] = transfer
        self.by_version[transfer.version] = transfer
        self.committed = transfer
        self._metrics.committed_version.set(transfer.version)

    def start(self) -> None:
        """Reconciles the configured replicas (nobody registers them): after a restart, each
        is brought to the committed version it may have missed."""
        for entry in self.engines.values():
            self._schedule_reconcile(entry)

    # -- registration ---------------------------------------------------------------------

    @property
    def committed_version(self) -> int:
        return self.committed.version if self.committed else 0

    @property
    def committed_id(self) -> str:
        """The transfer every serving replica holds ("" before the first commit)."""
        return self.committed.transfer_id if self.committed else INITIAL_WEIGHTS

    def live_entries(self) -> list[EngineEntry]:
        now, ttl = time.monotonic(), self._config.engines.registration_ttl_s
        return [e for e in self.engines.values() if e.live(now, ttl)]

    def register_engine(
        self, replica_id: str, url: str, current_version: int, *, routed: bool = False
    ) -> bool:
        """Adds or refreshes a replica and reconciles it in the background (see the module
        docstring); returns whether it is known not to hold the committed version."""
        entry = self.engines.get(replica_id)
        if entry is None or entry.url != url:
            if entry is not None:
                logger.info("replica %s moved from %s to %s", replica_id, entry.url, url)
            entry = self.engines[replica_id] = EngineEntry(
                replica_id, url, source="registered", version=current_version
            )
        entry.registered_at = time.monotonic()
        entry.routed = routed
        self._schedule_reconcile(entry)
        self._metrics.replica_version.labels(replica_id).set(entry.version)
        return entry.failed or entry.holds != self.committed_id

    def _schedule_reconcile(self, entry: EngineEntry) -> None:
        if entry.reconciling or time.monotonic() < entry.reconcile_after:
            return
        entry.reconciling = True
        self._spawn(self._reconcile(entry))

    async def _reconcile(self, entry: EngineEntry) -> None:
        """Under the switch lock: learn what the replica holds; bring it to the committed
        version if it does not hold it; tell the gateway it may route to it."""
        try:
            async with self._switch_lock:
                ok = await self._reconcile_locked(entry)
        except Exception as exc:  # a background task: log it, retry on the next registration
            logger.warning("reconciling replica %s failed: %s", entry.replica_id, exc)
            ok = False
        finally:
            entry.reconciling = False
        if ok:
            entry.num_failed_reconciles, entry.reconcile_after = 0, 0.0
        else:
            entry.num_failed_reconciles += 1
            delay = self._config.engines.retry_backoff_s * 2 ** (entry.num_failed_reconciles - 1)
            entry.reconcile_after = time.monotonic() + min(delay, _MAX_RECONCILE_BACKOFF_S)

    async def _reconcile_locked(self, entry: EngineEntry) -> bool:
        holds = await self._holds(entry)
        if holds == UNREACHABLE:
            entry.last_error = "unreachable"
            return False
        target = self.committed
        if holds == self.committed_id:
            entry.holds, entry.version, entry.failed = holds, self.committed_version, False
            self._metrics.replica_version.labels(entry.replica_id).set(entry.version)
            if not entry.routed:
                await self._resume([entry.replica_id], self.committed_version)
            return True
        entry.holds = holds
        if target is None:
            logger.warning(
                "replica %s holds weights (%s) this service has no record of and nothing is "
                "committed: it stays out of routing until the trainer publishes a version",
                entry.replica_id, holds,
            )  # fmt: skip
            return False
        logger.info(
            "replica %s holds %s, not the committed version %d (%s): loading it",
            entry.replica_id, holds or "its initial weights", target.version, target.transfer_id,
        )  # fmt: skip
        if self._gateway is not None:  # out of routing while it loads, whatever it was
            await self._gateway.pause(self._config.pause_mode, [entry.replica_id])
        outcomes = await self._load_replicas(
            [entry], target, restore=self._gateway is None, pause_engine={entry.replica_id}
        )
        if outcomes[entry.replica_id] != LOADED:
            return False
        logger.info("late joiner %s reached version %d", entry.replica_id, target.version)
        await self._resume([entry.replica_id], target.version)
        return True

    async def _holds(self, entry: EngineEntry) -> str | None:
        """What the replica's workers hold whole (one answer for all of them, or None for a
        mix); UNREACHABLE when they do not answer."""
        client = self._engine_factory(
            entry.url, min(_PING_TIMEOUT_S, self._config.engines.load_timeout_s)
        )
        try:
            answers = await client.worker_rpc("relayrl_ping", {})
        except Exception:
            return UNREACHABLE
        finally:
            await client.close()
        held = {a.get("holds") if isinstance(a, dict) else None for a in answers or [None]}
        return held.pop() if len(held) == 1 else None

    # -- publish and push -----------------------------------------------------------------

    def publish(
        self,
        version: int,
        trainer_step: int,
        metas: Sequence[common_pb2.TensorMeta],
        *,
        supersede: bool = False,
    ) -> Transfer:
        """The plan of `version`: created by the first sender, the same for every other one
        (whose manifest must match exactly). Versions only go forward, unless `supersede`
        (a trainer resumed from an older checkpoint) replaces a newer committed one."""
        if version < self.committed_version and not supersede:
            raise ValueError(
                f"version {version} is older than the committed version "
                f"{self.committed_version}; a trainer that resumed from an older checkpoint "
                "publishes its weights with supersede"
            )
        if not metas:
            raise ValueError("a version needs at least one tensor")
        manifest = manifest_digest(metas)
        existing = self.by_version.get(version)
        if existing is not None and existing.state not in (
            pb.TRANSFER_STATE_FAILED,
            pb.TRANSFER_STATE_COMMITTED,
        ):
            if existing.manifest != manifest:
                raise PlanMismatch(
                    f"version {version}: this sender's manifest differs from the transfer's "
                    f"({existing.transfer_id}); every trainer rank must export the same tensors"
                )
            return existing
        specs = [tensor_spec(m) for m in metas]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique within a version")
        layouts = plan_buckets(specs, self._config.bucket_size_bytes)
        transfer = Transfer(
            transfer_id=f"v{version}-{uuid.uuid4().hex[:8]}",
            version=version,
            trainer_step=trainer_step,
            metas=list(metas),
            manifest=manifest,
            layouts=layouts,
            plan_digest=plan_digest(layouts),
            buckets=[None] * len(layouts),
            sha256=[""] * len(layouts),
        )
        self.transfers[transfer.transfer_id] = transfer
        self.by_version[version] = transfer
        self._spawn(self._expire(transfer))
        self._metrics.transfers.labels("planned").inc()
        logger.info(
            "version %d: %d tensors, %d buckets, %d bytes (%s)",
            version, len(metas), len(layouts), transfer.num_bytes, transfer.transfer_id,
        )  # fmt: skip
        return transfer

    def plan_proto(self, transfer: Transfer) -> pb.BucketPlan:
        return transfer.plan_proto(
            self._config.bucket_size_bytes, self._config.data_plane.transport
        )

    def transfer(self, transfer_id: str) -> Transfer:
        try:
            return self.transfers[transfer_id]
        except KeyError:
            raise KeyError(f"unknown transfer {transfer_id!r}") from None

    def put_bucket(self, transfer_id: str, index: int, data: bytes, sha256: str) -> None:
        transfer = self.transfer(transfer_id)
        if transfer.state == pb.TRANSFER_STATE_FAILED:
            raise SyncError("transport", f"transfer {transfer_id} already failed: {transfer.error}")
        if not 0 <= index < len(transfer.layouts):
            raise PlanMismatch(
                f"bucket {index} is not in the plan of {transfer_id} "
                f"({len(transfer.layouts)} buckets)"
            )
        expected = transfer.layouts[index].size_bytes
        if len(data) != expected:
            raise PlanMismatch(
                f"bucket {index} of {transfer_id}: {len(data)} bytes, the plan says {expected}"
            )
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            self._metrics.failures.labels("transport").inc()
            raise SyncError(
                "transport", f"bucket {index} of {transfer_id}: checksum mismatch (corrupted)"
            )
        transfer.buckets[index] = data
        transfer.sha256[index] = actual
        self._metrics.bytes.labels("grpc").inc(len(data))
        if transfer.state == pb.TRANSFER_STATE_PLANNED:
            transfer.state = pb.TRANSFER_STATE_TRANSFERRING
        if all(b is not None for b in transfer.buckets) and not transfer.complete.is_set():
            transfer.complete.set()
            self._observe(transfer, "transport", time.monotonic() - transfer.created)
            self._spawn(self._switch(transfer))

    async def _expire(self, transfer: Transfer) -> None:
        try:
            await asyncio.wait_for(transfer.complete.wait(), self._config.transfer_timeout_s)
        except TimeoutError:
            missing = [i for i, b in enumerate(transfer.buckets) if b is None]
            self._fail(
                transfer,
                SyncError(
                    "transport",
                    f"{transfer.transfer_id}: buckets {missing[:8]} did not arrive within "
                    f"{self._config.transfer_timeout_s:.0f}s",
                ),
            )

    def _observe(self, transfer: Transfer, boundary: str, seconds: float) -> None:
        self._metrics.boundary_duration.labels(boundary).observe(seconds)
        transfer.durations_s[boundary] = max(seconds, transfer.durations_s.get(boundary, 0.0))

    def _log_transfer(self, transfer: Transfer, state: str) -> None:
        """One line of `metrics_log` per finished transfer (never fails the transfer)."""
        path = self._config.metrics_log
        if path is None:
            return
        record = {
            "version": transfer.version,
            "trainer_step": transfer.trainer_step,
            "state": state,
            "transport": self._config.data_plane.transport,
            "bytes": transfer.num_bytes,
            "replicas": list(transfer.replica_ids),
            "durations_s": {k: round(v, 6) for k, v in transfer.durations_s.items()},
            "error": transfer.error,
            "time": time.time(),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as log:
                log.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as exc:
            logger.warning("cannot write metrics_log %s: %s", path, exc)

    def _fail(self, transfer: Transfer, error: SyncError) -> None:
        transfer.state, transfer.error = pb.TRANSFER_STATE_FAILED, str(error)
        transfer.buckets = [None] * len(transfer.layouts)  # free the host memory
        self._metrics.failures.labels(error.boundary).inc()
        self._metrics.transfers.labels("failed").inc()
        transfer.done.set()
        self._log_transfer(transfer, "failed")
        logger.error("%s", error)

    # -- the switch -----------------------------------------------------------------------

    async def _switch(self, transfer: Transfer) -> None:
        async with self._switch_lock:  # one version switch (or reconciliation) at a time
            live = self.live_entries()
            transfer.replica_ids = [e.replica_id for e in live]
            transfer.state = pb.TRANSFER_STATE_LOADING
            start = time.monotonic()
            try:
                paused = await self._pause()
            except Exception as exc:
                self._fail(transfer, SyncError("switch", f"pausing rollout failed: {exc}"))
                await self._after_failed_switch(live)
                return
            try:
                # Replicas the gateway did not pause (not routed to: joining, or after a
                # failed load) are paused at the engine, so none computes during its load.
                unpaused = {e.replica_id for e in live} - set(paused)
                outcomes = await self._load_replicas(
                    live, transfer, restore=self._gateway is None, pause_engine=unpaused
                )
                loaded = [e.replica_id for e in live if outcomes[e.replica_id] == LOADED]
                refused = [e.replica_id for e in live if outcomes[e.replica_id] == REFUSED]
                transfer.replica_ids = loaded
                if refused and not loaded:
                    raise SyncError(
                        "load",
                        f"no replica loaded version {transfer.version} "
                        f"({', '.join(refused)} answered but could not load it)",
                    )
                await self._commit(transfer)
            except Exception as exc:
                error = exc if isinstance(exc, SyncError) else SyncError("load", repr(exc))
                self._fail(transfer, error)
                await self._after_failed_switch(live)
                return
            finally:
                self._observe(transfer, "pause_window", time.monotonic() - start)
            await self._resume(loaded, transfer.version)

    async def _after_failed_switch(self, live: list[EngineEntry]) -> None:
        """The previous version stays committed: replicas that still hold it go back to
        routing; the others (they hold a mix, or the version that failed) are held out of it
        until a reconciliation reloads them, so no other resume (a colocated trainer's) can
        route to them either."""
        good = [e.replica_id for e in live if e.holds == self.committed_id]
        await self._resume(good, self.committed_version)
        for entry in live:
            if entry.holds != self.committed_id and not entry.failed:
                entry.routed = False
                await self._hold(entry)

    async def _commit(self, transfer: Transfer) -> None:
        """Keeps the version in state_dir (before anyone is told), then makes it the one
        late joiners get; SyncError('restore') when it cannot be kept."""
        if self._store is not None:
            start = time.monotonic()
            try:
                await asyncio.to_thread(
                    self._store.save,
                    version=transfer.version,
                    trainer_step=transfer.trainer_step,
                    transfer_id=transfer.transfer_id,
                    metas=transfer.metas,
                    plan=self.plan_proto(transfer),
                    buckets=[b for b in transfer.buckets if b is not None],
                    sha256=transfer.sha256,
                )
            except OSError as exc:
                raise SyncError(
                    "restore",
                    f"cannot keep version {transfer.version} in {self._store.directory}: {exc}",
                ) from exc
            self._observe(transfer, "restore", time.monotonic() - start)
        previous = self.committed
        transfer.state = pb.TRANSFER_STATE_COMMITTED
        self.committed = transfer
        if previous is not None and previous is not transfer:
            previous.buckets = [None] * len(previous.layouts)  # only the latest stays in memory
        self._metrics.committed_version.set(transfer.version)
        self._metrics.transfers.labels("committed").inc()
        transfer.done.set()
        self._log_transfer(transfer, "committed")
        logger.info("version %d committed on %s", transfer.version, transfer.replica_ids)

    async def _pause(self) -> list[str]:
        """The gateway pauses the replicas it routes to; which ones it paused."""
        if self._gateway is None:
            return []
        return list(await self._gateway.pause(self._config.pause_mode))

    async def _resume(self, replica_ids: Sequence[str], version: int) -> None:
        """The gateway routes to `replica_ids` again, labelled `version` (a replica it no
        longer knows is skipped). A failure is logged: the replica stays out of routing, and
        its next registration reconciles it."""
        if self._gateway is None:
            return
        for replica_id in replica_ids:
            try:
                if await self._gateway.resume(replica_id, version):
                    self.engines[replica_id].routed = True
            except Exception as exc:
                logger.warning(
                    "could not resume replica %s at version %d: %s", replica_id, version, exc
                )

    async def _load_replicas(
        self,
        entries: list[EngineEntry],
        transfer: Transfer,
        *,
        restore: bool,
        pause_engine: set[str],
    ) -> dict[str, str]:
        """Load `transfer` into `entries` over the configured data plane, with retries; the
        outcome of each replica (LOADED, REFUSED, UNREACHABLE)."""
        if self._config.data_plane.transport == "grpc":
            outcomes = await asyncio.gather(
                *(
                    self._load_replica(
                        e, transfer, restore=restore, pause_engine=e.replica_id in pause_engine
                    )
                    for e in entries
                )
            )
            return {e.replica_id: o for e, o in zip(entries, outcomes, strict=True)}
        return await self._broadcast_to(
            entries, transfer, restore=restore, pause_engine=pause_engine
        )

    def _retry_delay_s(self, attempt: int) -> float:
        """The wait before try `attempt` (2, 3, ...) of a replica."""
        return self._config.engines.retry_backoff_s * 2 ** (attempt - 2)

    async def _load_replica(
        self, entry: EngineEntry, transfer: Transfer, *, restore: bool, pause_engine: bool
    ) -> str:
        """gRPC data plane: the replica's workers pull the buckets; its own retries."""
        settings = self._config.engines
        client = self._engine_factory(entry.url, settings.load_timeout_s)
        try:
            for attempt in range(1, settings.attempts + 1):
                if attempt > 1:
                    await asyncio.sleep(self._retry_delay_s(attempt))
                try:
                    await self._receive(
                        client, entry, transfer, {}, restore=restore, pause_engine=pause_engine
                    )
                    self._loaded(entry, transfer)
                    return LOADED
                except Exception as exc:
                    self._attempt_failed(entry, transfer, attempt, exc)
            return await self._give_up(entry)
        finally:
            await client.close()

    async def _broadcast_to(
        self,
        entries: list[EngineEntry],
        transfer: Transfer,
        *,
        restore: bool,
        pause_engine: set[str],
    ) -> dict[str, str]:
        """Broadcast data plane: one attempt sends every bucket once to every worker of the
        pending replicas; the replicas that failed it (a peer's death fails everyone's) go
        again, until they load or spend their attempts."""
        attempts = {e.replica_id: 0 for e in entries}
        outcomes: dict[str, str] = {}
        pending = list(entries)
        round_ = 0
        while pending:
            round_ += 1
            if round_ > 1:
                await asyncio.sleep(self._retry_delay_s(round_))
            errors = await self._broadcast_once(
                pending, transfer, round_, restore=restore, pause_engine=pause_engine
            )
            retry = []
            for entry in pending:
                error = errors.get(entry.replica_id)
                if error is None:
                    self._loaded(entry, transfer)
                    outcomes[entry.replica_id] = LOADED
                    continue
                attempts[entry.replica_id] += 1
                self._attempt_failed(entry, transfer, attempts[entry.replica_id], error)
                if attempts[entry.replica_id] < self._config.engines.attempts:
                    retry.append(entry)
                else:
                    outcomes[entry.replica_id] = await self._give_up(entry)
            pending = retry
        return outcomes

    async def _broadcast_once(
        self,
        entries: list[EngineEntry],
        transfer: Transfer,
        round_: int,
        *,
        restore: bool,
        pause_engine: set[str],
    ) -> dict[str, Exception]:
        """One attempt: count each replica's workers, give them consecutive receiver ranks,
        send from a thread while every replica receives. The replicas that failed, and why."""
        settings = self._config.engines
        clients = {
            e.replica_id: self._engine_factory(e.url, settings.load_timeout_s) for e in entries
        }
        errors: dict[str, Exception] = {}
        try:
            counts = await asyncio.gather(
                *(self._count_workers(e.url) for e in entries), return_exceptions=True
            )
            reachable: list[tuple[EngineEntry, int]] = []
            for entry, count in zip(entries, counts, strict=True):
                if isinstance(count, BaseException):
                    errors[entry.replica_id] = SyncError("load", f"replica unreachable: {count}")
                else:
                    reachable.append((entry, count))
            if not reachable:
                return errors
            spec = self._data_plane_spec(transfer, round_, sum(n for _, n in reachable))
            receiving = []
            base = 0
            for entry, count in reachable:
                extra = {
                    "transport": spec.type,
                    "spec": spec.to_json(),
                    "receiver_rank_base": base,
                    "bucket_sha256": transfer.sha256,
                }
                base += count
                client = clients[entry.replica_id]
                receiving.append(
                    asyncio.ensure_future(
                        self._receive(
                            client,
                            entry,
                            transfer,
                            extra,
                            restore=restore,
                            pause_engine=entry.replica_id in pause_engine,
                        )
                    )
                )
            start = time.monotonic()
            sending = asyncio.ensure_future(asyncio.to_thread(self._send_buckets, spec, transfer))
            await asyncio.wait([sending])  # every wait of the sender has a deadline
            if sending.exception() is None:
                self._metrics.delivered.labels(spec.type).inc(spec.total_bytes * base)
                self._metrics.delivery_rate.labels(spec.type).set(
                    spec.total_bytes / max(time.monotonic() - start, 1e-9)
                )
                await asyncio.wait(receiving)  # loading the last buckets; the RPC's deadline
            else:
                logger.warning(
                    "%s: sending over %s failed: %s",
                    transfer.transfer_id, spec.type, sending.exception(),
                )  # fmt: skip
                # Live receivers fail at once when the sender does; one that does not answer
                # soon is dead or stuck and must not hold up the retry of the others.
                _, stuck = await asyncio.wait(receiving, timeout=_ANSWER_AFTER_FAILURE_S)
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
            for (entry, _), task in zip(reachable, receiving, strict=True):
                if task.cancelled():
                    errors[entry.replica_id] = SyncError(
                        "load",
                        f"no answer within {_ANSWER_AFTER_FAILURE_S:g} s after the "
                        f"{spec.type} transfer failed (dead or stuck)",
                    )
                elif isinstance(task.exception(), Exception):
                    errors[entry.replica_id] = task.exception()  # type: ignore[assignment]
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)
        return errors

    async def _count_workers(self, url: str) -> int:
        """The replica's workers (one answer each); a short deadline, so that an engine whose
        server answers but whose workers died does not hold up the others."""
        client = self._engine_factory(
            url, min(_PING_TIMEOUT_S, self._config.engines.load_timeout_s)
        )
        try:
            answers = await client.worker_rpc("relayrl_ping", {})
        finally:
            await client.close()
        if not answers:
            raise SyncError("load", "the replica has no workers")
        return len(answers)

    def _data_plane_spec(self, transfer: Transfer, round_: int, receivers: int) -> TransportSpec:
        plane = self._config.data_plane
        host = plane.host or self._advertise_target().rpartition(":")[0].strip("[]")
        port = plane.rendezvous_port or _free_port(host)
        return TransportSpec(
            type=plane.transport,
            transfer_id=f"{transfer.transfer_id}-{round_}",
            num_senders=1,
            num_receivers=receivers,
            bucket_sizes=tuple(b.size_bytes for b in transfer.layouts),
            rendezvous=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            timeout_s=plane.timeout_s,
            device=plane.device,
            mooncake_protocol=plane.mooncake_protocol,
            mooncake_device_name=plane.mooncake_device_name,
        )

    def _send_buckets(self, spec: TransportSpec, transfer: Transfer) -> None:
        """This service as the only sender of `spec` (runs in a thread)."""
        import torch

        from relayrl.transfer.transports.base import open_sink

        resources = {"engine": self._mooncake_engine(spec)} if spec.type == "mooncake" else {}
        with open_sink(spec, 0, **resources) as sink, warnings.catch_warnings():
            # The buckets are immutable bytes; the data plane only reads them.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for index in range(spec.num_buckets):
                data = transfer.buckets[index]
                if data is None:
                    raise SyncError(
                        "transport", f"bucket {index} of {transfer.transfer_id} is gone"
                    )
                sink.send(index, torch.frombuffer(data, dtype=torch.uint8))

    def _mooncake_engine(self, spec: TransportSpec) -> Any:
        """One Mooncake engine for this service's lifetime (destroying one costs a second)."""
        if self._mooncake is None:
            from relayrl.transfer.transports.base import local_address_towards
            from relayrl.transfer.transports.mooncake import MooncakeEngine

            self._mooncake = MooncakeEngine(
                local_address_towards(spec.rendezvous_address[0]),
                protocol=spec.mooncake_protocol,
                device_name=spec.mooncake_device_name,
            )
        return self._mooncake

    async def _receive(
        self,
        client: Any,
        entry: EngineEntry,
        transfer: Transfer,
        extra: dict[str, Any],
        *,
        restore: bool,
        pause_engine: bool = False,
    ) -> None:
        """One replica receives and loads `transfer` (`extra`: the data plane's part of the
        request) and every worker's checksums are checked. The replica is paused at the
        engine first with `restore` (no gateway drives the switch) or `pause_engine` (the
        gateway did not pause it); with `restore` it is also restored here. While it loads
        its label says so (`loading_label`): a half-loaded model never carries a version."""
        start = time.monotonic()
        request = {
            "transport": "grpc",
            "target": self._advertise_target(),
            "transfer_id": transfer.transfer_id,
            "plan_digest": transfer.plan_digest,
            "replica_id": entry.replica_id,
            "timeout_s": self._config.engines.load_timeout_s,
            **extra,
        }
        if restore or pause_engine:
            await client.pause(self._config.pause_mode)
        entry.holds = None  # from here until it answers, the replica may hold a mix
        await client.set_weight_version(loading_label(transfer.version))
        answers = await client.worker_rpc("relayrl_receive", request)
        for answer in answers:
            if answer.get("bucket_sha256") != transfer.sha256:
                raise SyncError("load", "a worker loaded buckets whose checksums differ")
        self._observe(transfer, "load", time.monotonic() - start)
        if restore:  # a replica that fails above stays paused until a retry loads it
            start = time.monotonic()
            await client.reset_prefix_cache()
            await client.set_weight_version(str(transfer.version))
            await client.resume()
            self._observe(transfer, "restore", time.monotonic() - start)

    def _loaded(self, entry: EngineEntry, transfer: Transfer) -> None:
        entry.version, entry.holds, entry.last_error = transfer.version, transfer.transfer_id, ""
        entry.failed = False
        self._metrics.replica_version.labels(entry.replica_id).set(transfer.version)

    def _attempt_failed(
        self, entry: EngineEntry, transfer: Transfer, attempt: int, exc: Exception
    ) -> None:
        boundary = exc.boundary if isinstance(exc, SyncError) else "load"
        entry.last_error = f"{boundary}: {exc}" if not str(exc).startswith(boundary) else str(exc)
        self._metrics.failures.labels(boundary).inc()
        logger.warning(
            "replica %s, version %d, attempt %d/%d: %s",
            entry.replica_id, transfer.version, attempt, self._config.engines.attempts,
            entry.last_error,
        )  # fmt: skip

    async def _hold(self, entry: EngineEntry) -> None:
        """The gateway keeps `entry` out of routing until a resume names a version."""
        if self._gateway is None:
            return
        try:
            await self._gateway.hold(
                entry.replica_id, entry.last_error or "not at the committed version"
            )
        except Exception as exc:  # it is paused at the engine, and we never resume it
            logger.warning("could not hold replica %s: %s", entry.replica_id, exc)

    async def _give_up(self, entry: EngineEntry) -> str:
        """The replica spent its attempts: out of switches (and of routing: the gateway is
        never told to resume it) until a reconciliation loads a whole version into it.
        Whether it still answers tells a refusal from a death."""
        entry.failed, entry.holds, entry.routed = True, None, False
        await self._hold(entry)
        answers = await self._holds(entry)
        outcome = UNREACHABLE if answers == UNREACHABLE else REFUSED
        logger.warning(
            "replica %s is out of routing until it is reloaded (%s: %s)",
            entry.replica_id, outcome, entry.last_error,
        )  # fmt: skip
        return outcome

    # -- bookkeeping ----------------------------------------------------------------------

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._mooncake is not None:
            self._mooncake.close()
            self._mooncake = None


def _free_port(host: str) -> int:
    """A port free on `host` now (the rendezvous store binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])
