"""The record of versions: every transfer weight-sync knows (planned from the senders'
manifests, its buckets as they arrive), which one is committed, and what commit and failure
mean for that record -- the committed version is written to `state_dir` before anyone is told,
only the latest stays in host memory, and every finished transfer is one line of `metrics_log`.

The boundaries a version crosses (export, transport, switch, load, restore) are named by
`SyncError`; see `relayrl.weightsync.coordinator` for the switch that moves a transfer from
complete to committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from relayrl.core.records import TransferRecord, append_record
from relayrl.dataplane.delta import DeltaError
from relayrl.dataplane.delta import apply as apply_delta
from relayrl.dataplane.plan import BucketLayout, Piece, TensorSpec, plan_buckets, plan_digest
from relayrl.dataplane.request import INITIAL_WEIGHTS
from relayrl.dataplane.shm import ShmArea, map_bucket
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.state import CommittedStore, StoredVersion

TRANSPORT_TYPES = {
    "grpc": pb.TRANSPORT_TYPE_GRPC,
    "torch_distributed": pb.TRANSPORT_TYPE_TORCH_DISTRIBUTED,
    "mooncake": pb.TRANSPORT_TYPE_MOONCAKE,
    "shm": pb.TRANSPORT_TYPE_SHM,
}

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


Bucket = bytes | mmap.mmap
"""A bucket as the service holds it: bytes pushed over gRPC (or read back from state_dir), or
the sender's shared-memory file, mapped read-only."""


@dataclass
class Transfer:
    transfer_id: str
    version: int
    trainer_step: int
    metas: list[common_pb2.TensorMeta]
    manifest: str
    layouts: list[BucketLayout]
    plan_digest: str
    buckets: list[Bucket | None]
    sha256: list[str]
    state: int = pb.TRANSFER_STATE_PLANNED
    error: str = ""
    replica_ids: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    # Seconds per boundary of this transfer (load and restore: the slowest replica).
    durations_s: dict[str, float] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set, and replaced by a fresh one, whenever a bucket arrives or the transfer fails: what
    # a cut-through puller waits on (`Versions.bucket`).
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The committed transfer whose buckets this one's delta buckets apply to, and those
    # buckets (held here: committing another version frees the base's own list).
    delta_base_id: str = ""
    delta_base: list[Bucket | None] | None = None
    # The shared-memory data plane: the slot folder senders on this host write the buckets
    # into (relayrl.dataplane.shm), while the transfer holds it.
    shm_slot: Path | None = None

    @property
    def num_bytes(self) -> int:
        return sum(b.size_bytes for b in self.layouts)

    @property
    def failed(self) -> bool:
        return self.state == pb.TRANSFER_STATE_FAILED

    def notify(self) -> None:
        """Wakes everyone waiting on `changed`."""
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def plan_proto(
        self, bucket_size_bytes: int, transport: str, shm_token: str = ""
    ) -> pb.BucketPlan:
        """The plan as senders and receivers see it; `transport` is the data plane from this
        service to the engines (senders push over gRPC, or into `shm_slot` on this host)."""
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
            delta_base_transfer_id=self.delta_base_id,
            shm_dir=str(self.shm_slot or ""),
            shm_token=shm_token if self.shm_slot else "",
        )


def _failed(transfer: Transfer) -> SyncError:
    """What a puller or the switch waiting on a failed transfer is told."""
    return SyncError("transport", f"transfer {transfer.transfer_id} failed: {transfer.error}")


class Versions:
    """Every transfer and the committed one. `spawn` runs a background coroutine (the deadline
    of a transfer's buckets) under the coordinator's care."""

    def __init__(
        self,
        config: WeightSyncConfig,
        metrics: WeightSyncMetrics,
        *,
        spawn: Callable[[Awaitable[Any]], None],
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._spawn = spawn
        self.transfers: dict[str, Transfer] = {}
        self.by_version: dict[int, Transfer] = {}
        self.committed: Transfer | None = None
        self._store = CommittedStore(config.state_dir) if config.state_dir else None
        plane = config.data_plane
        self._shm = ShmArea(plane.shm_dir) if plane.transport == "shm" else None
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

    @property
    def committed_version(self) -> int:
        return self.committed.version if self.committed else 0

    @property
    def committed_id(self) -> str:
        """The transfer every serving replica holds ("" before the first commit)."""
        return self.committed.transfer_id if self.committed else INITIAL_WEIGHTS

    # -- publish and push -----------------------------------------------------------------

    def publish(
        self,
        version: int,
        trainer_step: int,
        metas: Sequence[common_pb2.TensorMeta],
        *,
        supersede: bool = False,
        base_transfer_id: str = "",
    ) -> Transfer:
        """The plan of `version`: created by the first sender, the same for every other one
        (whose manifest must match exactly). Versions only go forward, unless `supersede`
        (a trainer resumed from an older checkpoint) replaces a newer committed one.

        `base_transfer_id`: the version the first sender's delta buckets are made from. It is
        accepted only while it is the committed one, with the same bucket plan and its buckets
        in memory; the plan's `delta_base_transfer_id` tells the senders."""
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
            shm_slot=self._shm.acquire() if self._shm else None,
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
        base = self.committed
        if (
            base_transfer_id
            and base is not None
            and base.transfer_id == base_transfer_id
            and base.plan_digest == transfer.plan_digest
            and all(b is not None for b in base.buckets)
        ):
            transfer.delta_base_id, transfer.delta_base = base.transfer_id, base.buckets
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
            self._config.bucket_size_bytes,
            self._config.data_plane.transport,
            self._shm.token if self._shm else "",
        )

    def transfer(self, transfer_id: str) -> Transfer:
        try:
            return self.transfers[transfer_id]
        except KeyError:
            raise KeyError(f"unknown transfer {transfer_id!r}") from None

    def put_bucket(
        self,
        transfer_id: str,
        index: int,
        data: bytes,
        sha256: str,
        *,
        delta: bool = False,
        shm: bool = False,
    ) -> bool:
        """Keeps one bucket a sender pushed (`delta`: rebuilt from the transfer's delta base
        first; `shm`: the sender wrote it into the transfer's shared-memory slot, and `data` is
        empty); whether it completed its transfer."""
        transfer = self.transfer(transfer_id)
        if transfer.state == pb.TRANSFER_STATE_FAILED:
            raise SyncError("transport", f"transfer {transfer_id} already failed: {transfer.error}")
        if not 0 <= index < len(transfer.layouts):
            raise PlanMismatch(
                f"bucket {index} is not in the plan of {transfer_id} "
                f"({len(transfer.layouts)} buckets)"
            )
        expected = transfer.layouts[index].size_bytes
        if shm:
            data = self._mapped(transfer, index, expected)
        wire_bytes = len(data)
        if delta:
            data = self._rebuilt(transfer, index, data)
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
        self._metrics.bytes.labels("shm" if shm else "grpc").inc(wire_bytes)
        if transfer.state == pb.TRANSFER_STATE_PLANNED:
            transfer.state = pb.TRANSFER_STATE_TRANSFERRING
        completed = False
        if all(b is not None for b in transfer.buckets) and not transfer.complete.is_set():
            transfer.complete.set()
            self.observe(transfer, "transport", time.monotonic() - transfer.created)
            completed = True
        transfer.notify()
        return completed

    async def bucket(self, transfer: Transfer, index: int) -> bytes:
        """Bucket `index` of `transfer` as soon as a sender has pushed it (cut-through: a
        puller need not wait for the whole version). SyncError when the transfer failed, or is
        no longer in memory (a newer version was committed since); the wait ends with the
        transfer's own deadline at the latest (`transfer_timeout_s` fails it)."""
        while True:
            if transfer.failed:
                raise _failed(transfer)
            data = transfer.buckets[index]
            if data is not None:
                return data
            if transfer.complete.is_set():
                raise SyncError(
                    "transport",
                    f"transfer {transfer.transfer_id} is no longer in memory (version "
                    f"{self.committed_version} was committed since)",
                )
            await transfer.changed.wait()

    async def arrived(self, transfer: Transfer) -> None:
        """Until every bucket of `transfer` has arrived; SyncError when it failed instead."""
        while not transfer.complete.is_set() and not transfer.failed:
            await transfer.changed.wait()
        if transfer.failed:
            raise _failed(transfer)

    @staticmethod
    def _mapped(transfer: Transfer, index: int, size: int) -> Bucket:
        """Bucket `index` as the sender left it in the transfer's shared-memory slot."""
        if transfer.shm_slot is None:
            raise PlanMismatch(
                f"bucket {index} of {transfer.transfer_id} is marked shm, but the plan gave no "
                "shm_dir; push its bytes"
            )
        try:
            return map_bucket(transfer.shm_slot, index, size)
        except OSError as exc:
            raise SyncError(
                "transport", f"bucket {index} of {transfer.transfer_id} in shared memory: {exc}"
            ) from None

    @staticmethod
    def _rebuilt(transfer: Transfer, index: int, delta: bytes) -> bytes:
        """The full bucket a delta bucket makes of the transfer's delta base."""
        if transfer.delta_base is None:
            raise PlanMismatch(
                f"bucket {index} of {transfer.transfer_id} is a delta, but the plan accepted no "
                "delta base; push it in full"
            )
        base = transfer.delta_base[index]
        assert base is not None  # held since publish
        try:
            return apply_delta(base, delta)
        except DeltaError as exc:
            raise SyncError(
                "transport",
                f"bucket {index} of {transfer.transfer_id}: a delta that does not fit its base "
                f"{transfer.delta_base_id}: {exc}",
            ) from None

    async def _expire(self, transfer: Transfer) -> None:
        try:
            await asyncio.wait_for(transfer.complete.wait(), self._config.transfer_timeout_s)
        except TimeoutError:
            missing = [i for i, b in enumerate(transfer.buckets) if b is None]
            self.fail(
                transfer,
                SyncError(
                    "transport",
                    f"{transfer.transfer_id}: buckets {missing[:8]} did not arrive within "
                    f"{self._config.transfer_timeout_s:.0f}s",
                ),
            )

    # -- outcomes -------------------------------------------------------------------------

    def observe(self, transfer: Transfer, boundary: str, seconds: float) -> None:
        self._metrics.boundary_duration.labels(boundary).observe(seconds)
        transfer.durations_s[boundary] = max(seconds, transfer.durations_s.get(boundary, 0.0))

    def _log_transfer(self, transfer: Transfer, state: Literal["committed", "failed"]) -> None:
        """One line of `metrics_log` per finished transfer (never fails the transfer)."""
        path = self._config.metrics_log
        if path is None:
            return
        record = TransferRecord(
            version=transfer.version,
            trainer_step=transfer.trainer_step,
            state=state,
            transport=self._config.data_plane.transport,
            bytes=transfer.num_bytes,
            replicas=list(transfer.replica_ids),
            durations_s={k: round(v, 6) for k, v in transfer.durations_s.items()},
            error=transfer.error,
            time=time.time(),
        )
        try:
            append_record(path, record)
        except OSError as exc:
            logger.warning("cannot write metrics_log %s: %s", path, exc)

    def _drop_buckets(self, transfer: Transfer) -> None:
        """Frees the host memory of `transfer`'s buckets, and its shared-memory slot."""
        transfer.buckets = [None] * len(transfer.layouts)
        if transfer.shm_slot is not None and self._shm is not None:
            self._shm.release(transfer.shm_slot)
            transfer.shm_slot = None

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()

    def fail(self, transfer: Transfer, error: SyncError) -> None:
        transfer.state, transfer.error = pb.TRANSFER_STATE_FAILED, str(error)
        self._drop_buckets(transfer)
        transfer.delta_base = None
        self._metrics.failures.labels(error.boundary).inc()
        self._metrics.transfers.labels("failed").inc()
        transfer.done.set()
        transfer.notify()
        self._log_transfer(transfer, "failed")
        logger.error("%s", error)

    def stage(self, transfer: Transfer) -> asyncio.Future[str] | None:
        """Starts writing `transfer` into state_dir as soon as all its buckets are here, while
        the replicas load it: the commit then waits only for what the write has left (None:
        no state_dir). Whoever stages a transfer commits it or `unstage`s it."""
        store = self._store
        if store is None:
            return None

        async def write() -> str:
            await self.arrived(transfer)
            return await asyncio.to_thread(
                store.stage,
                version=transfer.version,
                trainer_step=transfer.trainer_step,
                transfer_id=transfer.transfer_id,
                metas=transfer.metas,
                plan=self._stored_plan(transfer),
                buckets=[b for b in transfer.buckets if b is not None],
            )

        return asyncio.ensure_future(write())

    async def unstage(self, transfer: Transfer, staged: asyncio.Future[str] | None) -> None:
        """Removes what `stage` wrote for a transfer that will not be committed. A write still
        waiting for buckets is cancelled, not awaited: the push may never end. One that has all
        its buckets is on disk or being written (a thread cannot be cancelled): it is awaited,
        then removed."""
        if staged is None or self._store is None:
            return
        if not staged.done() and any(b is None for b in transfer.buckets):
            staged.cancel()
            return
        try:
            folder = await staged
        except Exception:  # the write failed, or its transfer did: nothing is kept
            return
        await asyncio.to_thread(self._store.discard, folder)

    def _stored_plan(self, transfer: Transfer) -> pb.BucketPlan:
        """The plan as state_dir keeps it: without the shared-memory slot, which goes with this
        process."""
        return transfer.plan_proto(
            self._config.bucket_size_bytes, self._config.data_plane.transport
        )

    async def commit(self, transfer: Transfer, staged: asyncio.Future[str] | None) -> None:
        """Keeps the version in state_dir (before anyone is told), then makes it the one
        late joiners get; SyncError('restore') when it cannot be kept. `staged`: what
        `stage(transfer)` returned. The restore duration is how long the commit waited for
        the disk."""
        if self._store is not None:
            assert staged is not None, "stage() writes whenever there is a state_dir"
            start = time.monotonic()
            try:
                folder = await staged
                await asyncio.to_thread(
                    self._store.point,
                    version=transfer.version,
                    trainer_step=transfer.trainer_step,
                    transfer_id=transfer.transfer_id,
                    folder=folder,
                    plan=self._stored_plan(transfer),
                    sha256=transfer.sha256,
                )
            except OSError as exc:
                raise SyncError(
                    "restore",
                    f"cannot keep version {transfer.version} in {self._store.directory}: {exc}",
                ) from exc
            self.observe(transfer, "restore", time.monotonic() - start)
        previous = self.committed
        transfer.state = pb.TRANSFER_STATE_COMMITTED
        transfer.delta_base = None
        self.committed = transfer
        if previous is not None and previous is not transfer:
            self._drop_buckets(previous)  # only the latest stays in memory
        self._metrics.committed_version.set(transfer.version)
        self._metrics.transfers.labels("committed").inc()
        transfer.done.set()
        self._log_transfer(transfer, "committed")
        logger.info("version %d committed on %s", transfer.version, transfer.replica_ids)
