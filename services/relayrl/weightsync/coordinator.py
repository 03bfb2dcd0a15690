"""The weight-sync service's logic: transfers, the version switch, commit, late joiners.

A version moves through the five boundaries of 003 §6.0, each with its own metric and error:

    export     trainer ranks export HF-named tensors (bf16, or FP8 + scales) -- sender side
    transport  senders push buckets (checksummed) to this service, which keeps them in host
               memory; receivers pull them from here (the gRPC data plane)
    switch     the gateway pauses the replicas (abort | keep | wait)
    load       every live replica's worker extension pulls the buckets, checks each bucket's
               sha256 and loads the tensors through vLLM's load path
    restore    prefix cache reset, weight version set, replicas resumed

A version is committed only when every live replica has loaded it. A replica that fails to
load (after `engines.attempts` tries) is taken out of routing and marked not live, so the
gateway never serves a half-loaded model nor routes to a replica at an old version after the
switch. The committed version's buckets stay in host memory: a replica that registers later
(a new or restarted engine) pulls it at once, without involving the trainer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.plan import BucketLayout, Piece, TensorSpec, plan_buckets, plan_digest

logger = logging.getLogger(__name__)


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
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_bytes(self) -> int:
        return sum(b.size_bytes for b in self.layouts)

    def plan_proto(self, bucket_size_bytes: int) -> pb.BucketPlan:
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
            transport=pb.TRANSPORT_TYPE_GRPC,
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
        ok = await self._load_replica(entry, transfer, restore=True)
        logger.info(
            "late joiner %s %s version %d",
            entry.replica_id,
            "reached" if ok else "failed",
            transfer.version,
        )

    # -- publish and push -----------------------------------------------------------------

    def publish(
        self, version: int, trainer_step: int, metas: Sequence[common_pb2.TensorMeta]
    ) -> Transfer:
        """The plan of `version`: created by the first sender, the same for every other one
        (whose manifest must match exactly)."""
        if version < self.committed_version:
            raise ValueError(
                f"version {version} is older than the committed version {self.committed_version}"
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
            self._metrics.boundary_duration.labels("transport").observe(
                time.monotonic() - transfer.created
            )
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

    def _fail(self, transfer: Transfer, error: SyncError) -> None:
        transfer.state, transfer.error = pb.TRANSFER_STATE_FAILED, str(error)
        transfer.buckets = [None] * len(transfer.layouts)  # free the host memory
        self._metrics.failures.labels(error.boundary).inc()
        self._metrics.transfers.labels("failed").inc()
        transfer.done.set()
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
                results = await asyncio.gather(
                    *(self._load_replica(e, transfer, restore=self._gateway is None) for e in live)
                )
                if not any(results) and live:
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
                self._metrics.boundary_duration.labels("pause_window").observe(
                    time.monotonic() - start
                )
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
        logger.info("version %d committed on %s", transfer.version, transfer.replica_ids)

    async def _pause(self) -> None:
        if self._gateway is not None:
            await self._gateway.pause(self._config.pause_mode)

    async def _resume(self, version: int | None) -> None:
        if self._gateway is not None:
            await self._gateway.resume(version)

    async def _load_replica(self, entry: EngineEntry, transfer: Transfer, *, restore: bool) -> bool:
        """Load into one replica, with retries; on final failure the replica leaves routing."""
        settings = self._config.engines
        client = self._engine_factory(entry.url, settings.load_timeout_s)
        try:
            for attempt in range(1, settings.attempts + 1):
                try:
                    await self._load_once(client, entry, transfer, restore=restore)
                    entry.version, entry.last_error = transfer.version, ""
                    self._metrics.replica_version.labels(entry.replica_id).set(transfer.version)
                    return True
                except Exception as exc:
                    boundary = exc.boundary if isinstance(exc, SyncError) else "load"
                    entry.last_error = f"{boundary}: {exc}"
                    self._metrics.failures.labels(boundary).inc()
                    logger.warning(
                        "replica %s, version %d, attempt %d/%d: %s",
                        entry.replica_id, transfer.version, attempt, settings.attempts,
                        entry.last_error,
                    )  # fmt: skip
            entry.live = False
            if self._gateway is not None:
                await self._gateway.drain(entry.replica_id, entry.last_error)
            return False
        finally:
            await client.close()

    async def _load_once(
        self, client: Any, entry: EngineEntry, transfer: Transfer, *, restore: bool
    ) -> None:
        start = time.monotonic()
        request = {
            "transport": "grpc",
            "target": self._advertise_target(),
            "transfer_id": transfer.transfer_id,
            "plan_digest": transfer.plan_digest,
            "replica_id": entry.replica_id,
            "timeout_s": self._config.engines.load_timeout_s,
        }
        answers = await client.worker_rpc("relayrl_receive", request)
        for answer in answers:
            if answer.get("bucket_sha256") != transfer.sha256:
                raise SyncError("load", "a worker loaded buckets whose checksums differ")
        self._metrics.boundary_duration.labels("load").observe(time.monotonic() - start)
        if restore:  # without a gateway the service restores the replica itself
            start = time.monotonic()
            await client.reset_prefix_cache()
            await client.set_weight_version(str(transfer.version))
            self._metrics.boundary_duration.labels("restore").observe(time.monotonic() - start)

    # -- bookkeeping ----------------------------------------------------------------------

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
