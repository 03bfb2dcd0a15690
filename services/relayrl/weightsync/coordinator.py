"""The weight-sync service's logic: transfers, the version switch, commit, late joiners.

A version moves through the five boundaries of 003 §6.0, each with its own metric and error:

    export     trainer ranks export HF-named tensors (bf16, or FP8 + scales) -- sender side
    transport  senders push buckets (checksummed) to this service, which keeps them in host
               memory
    switch     the gateway pauses the replicas (abort | keep | wait)
    load       the buckets go to every worker of every live replica over the configured data
               plane -- each worker pulls them over gRPC, or this service broadcasts them
               (torch_distributed) or writes them (mooncake) to all workers at once -- and the
               worker extension checks each bucket's sha256 and loads the tensors through
               vLLM's load path
    restore    prefix cache reset, weight version set, replicas resumed

A version is committed only when every live replica has loaded it. A replica that fails to
load (after `engines.attempts` tries) is taken out of routing and marked not live, so the
gateway never serves a half-loaded model nor routes to a replica at an old version after the
switch. With a broadcast data plane one attempt serves every replica, so a replica that dies
mid-transfer fails the attempt for all: the next attempt goes to the replicas that still
answer, and the dead one is dropped once its attempts are spent. The committed version's
buckets stay in host memory: a replica that registers later (a new or restarted engine) gets
it at once, without involving the trainer.
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

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.plan import BucketLayout, Piece, TensorSpec, plan_buckets, plan_digest
from relayrl.weightsync.transports.base import TransportSpec

TRANSPORT_TYPES = {
    "grpc": pb.TRANSPORT_TYPE_GRPC,
    "torch_distributed": pb.TRANSPORT_TYPE_TORCH_DISTRIBUTED,
    "mooncake": pb.TRANSPORT_TYPE_MOONCAKE,
}

logger = logging.getLogger(__name__)

_PING_TIMEOUT_S = 10.0
_ANSWER_AFTER_FAILURE_S = 10.0


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
    replica_id: str
    url: str
    version: int = 0
    live: bool = True
    last_error: str = ""


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
        self._switch_lock = asyncio.Lock()
        self._mooncake: Any = None  # the Mooncake engine, started on first use
        self._tasks: set[asyncio.Task[Any]] = set()
        for url in config.engines.urls:
            self.engines[url] = EngineEntry(url, url)

    # -- registration ---------------------------------------------------------------------

    @property
    def committed_version(self) -> int:
        return self.committed.version if self.committed else 0

    def register_engine(self, replica_id: str, url: str, current_version: int) -> bool:
        """Adds (or refreshes) a replica; returns whether it must pull the committed version,
        which then starts at once in the background."""
        entry = self.engines.get(replica_id)
        if entry is None:
            entry = self.engines[replica_id] = EngineEntry(replica_id, url)
        entry.url, entry.version, entry.live = url, current_version, True
        needs_pull = self.committed is not None and current_version != self.committed.version
        if needs_pull:
            assert self.committed is not None
            self._spawn(self._catch_up(entry, self.committed))
        self._metrics.replica_version.labels(replica_id).set(current_version)
        return needs_pull

    async def _catch_up(self, entry: EngineEntry, transfer: Transfer) -> None:
        async with self._switch_lock:  # not while a switch moves the replicas to a newer one
            if self.committed is not None:
                transfer = self.committed
            if entry.version == transfer.version:
                return
            (ok,) = await self._load_replicas([entry], transfer, restore=True)
        logger.info(
            "late joiner %s %s version %d",
            entry.replica_id,
            "reached" if ok else "failed",
            transfer.version,
        )

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
        async with self._switch_lock:  # one version switch at a time
            live = [e for e in self.engines.values() if e.live]
            transfer.replica_ids = [e.replica_id for e in live]
            transfer.state = pb.TRANSFER_STATE_LOADING
            start = time.monotonic()
            try:
                await self._pause()
            except Exception as exc:
                self._fail(transfer, SyncError("switch", f"pausing rollout failed: {exc}"))
                return
            try:
                results = await self._load_replicas(live, transfer, restore=self._gateway is None)
                transfer.replica_ids = [
                    e.replica_id for e, ok in zip(live, results, strict=True) if ok
                ]
                if not transfer.replica_ids and live:
                    raise SyncError("load", f"no replica loaded version {transfer.version}")
                await self._resume(transfer.version)
            except SyncError as exc:
                self._fail(transfer, exc)
                await self._resume(None)
                return
            except Exception as exc:
                self._fail(transfer, SyncError("restore", str(exc)))
                return
            finally:
                self._observe(transfer, "pause_window", time.monotonic() - start)
            self._commit(transfer)

    def _commit(self, transfer: Transfer) -> None:
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

    async def _pause(self) -> None:
        if self._gateway is not None:
            await self._gateway.pause(self._config.pause_mode)

    async def _resume(self, version: int | None) -> None:
        if self._gateway is not None:
            await self._gateway.resume(version)

    async def _load_replicas(
        self, entries: list[EngineEntry], transfer: Transfer, *, restore: bool
    ) -> list[bool]:
        """Load `transfer` into `entries` over the configured data plane, with retries; a
        replica that spends its attempts leaves routing. Whether each one loaded it."""
        if self._config.data_plane.transport == "grpc":
            return list(
                await asyncio.gather(
                    *(self._load_replica(e, transfer, restore=restore) for e in entries)
                )
            )
        return await self._broadcast_to(entries, transfer, restore=restore)

    async def _load_replica(self, entry: EngineEntry, transfer: Transfer, *, restore: bool) -> bool:
        """gRPC data plane: the replica's workers pull the buckets; its own retries."""
        settings = self._config.engines
        client = self._engine_factory(entry.url, settings.load_timeout_s)
        try:
            for attempt in range(1, settings.attempts + 1):
                try:
                    await self._receive(client, entry, transfer, {}, restore=restore)
                    self._loaded(entry, transfer)
                    return True
                except Exception as exc:
                    self._attempt_failed(entry, transfer, attempt, exc)
            await self._drop(entry)
            return False
        finally:
            await client.close()

    async def _broadcast_to(
        self, entries: list[EngineEntry], transfer: Transfer, *, restore: bool
    ) -> list[bool]:
        """Broadcast data plane: one attempt sends every bucket once to every worker of the
        pending replicas; the replicas that failed it (a peer's death fails everyone's) go
        again, until they load or spend their attempts."""
        attempts = {e.replica_id: 0 for e in entries}
        loaded: set[str] = set()
        pending = list(entries)
        round_ = 0
        while pending:
            round_ += 1
            errors = await self._broadcast_once(pending, transfer, round_, restore=restore)
            retry = []
            for entry in pending:
                error = errors.get(entry.replica_id)
                if error is None:
                    self._loaded(entry, transfer)
                    loaded.add(entry.replica_id)
                    continue
                attempts[entry.replica_id] += 1
                self._attempt_failed(entry, transfer, attempts[entry.replica_id], error)
                if attempts[entry.replica_id] < self._config.engines.attempts:
                    retry.append(entry)
                else:
                    await self._drop(entry)
            pending = retry
        return [e.replica_id in loaded for e in entries]

    async def _broadcast_once(
        self, entries: list[EngineEntry], transfer: Transfer, round_: int, *, restore: bool
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
                        self._receive(client, entry, transfer, extra, restore=restore)
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

        from relayrl.weightsync.transports.base import open_sink

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
            from relayrl.weightsync.transports.base import local_address_towards
            from relayrl.weightsync.transports.mooncake import MooncakeEngine

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
    ) -> None:
        """One replica receives and loads `transfer` (`extra`: the data plane's part of the
        request) and every worker's checksums are checked. With `restore` (no gateway drives
        the switch, or a late joiner) the replica is paused around it and restored here."""
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
        if restore:  # nobody else paused it: no generation may see a half-loaded model
            await client.pause(self._config.pause_mode)
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
        entry.version, entry.last_error = transfer.version, ""
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

    async def _drop(self, entry: EngineEntry) -> None:
        """Out of routing: the replica spent its attempts."""
        entry.live = False
        if self._gateway is not None:
            await self._gateway.drain(entry.replica_id, entry.last_error)

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
