"""The weight-sync service's logic: transfers, the version switch, commit, late joiners.

A version moves through the five boundaries of docs/weightsync.md#boundaries (what a death at
each means: docs/recovery.md), each with its own metric and error:

    export     trainer ranks export HF-named tensors (bf16, or FP8 + scales) -- sender side
    transport  senders push buckets (checksummed) to this service, which keeps them in host
               memory
    switch     the gateway pauses the replicas (abort | keep | wait)
    load       the buckets go to every worker of every live replica over the configured data
               plane -- each worker pulls them over gRPC (cut through: each bucket as soon as
               it is here, while the senders still push the rest), or this service broadcasts them
               (torch_distributed) or writes them (mooncake) to all workers at once -- and the
               worker extension checks each bucket's sha256 and loads the tensors through
               vLLM's load path
    restore    the version is committed (written to `state_dir` first), then the replicas
               that loaded it get their prefix cache reset, the version label and are resumed

The `Coordinator` puts together the pieces, each in its own module: the record of transfers and
of the committed version (`versions`), the replicas and their reconciliation with the committed
version (`membership`), loading a transfer into replicas over the data plane (`loading`), and
the gateway calls (`routing`). It runs the version switch itself.

Commit. A version commits when every live replica has loaded it, or has spent its attempts
(with a backoff that gives a restarting engine time to come back) and is then left out of
routing until a reconciliation loads it. The exception is a version that every replica that
answered refused: it fails, and the previous version stays committed. The committed version
stays in host memory and in `state_dir`, so that late joiners get it without the trainer,
also after a restart of this service.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relayrl.core.interceptors import MintedTokens
from relayrl.dataplane.data_planes import DATA_PLANES
from relayrl.dataplane.request import INITIAL_WEIGHTS
from relayrl.dataplane.transports.base import KeptResources, TransportSpec
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.loading import (
    LOADED,
    REFUSED,
    UNREACHABLE,
    BroadcastLoader,
    EngineFactory,
    Loader,
    PullLoader,
    loading_label,
)
from relayrl.weightsync.membership import EngineEntry, Membership
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.routing import Routing
from relayrl.weightsync.versions import (
    TRANSPORT_TYPES,
    PlanMismatch,
    SyncError,
    Transfer,
    Versions,
    manifest_digest,
    tensor_spec,
)

__all__ = [
    "INITIAL_WEIGHTS",
    "LOADED",
    "REFUSED",
    "TRANSPORT_TYPES",
    "UNREACHABLE",
    "Coordinator",
    "EngineEntry",
    "EngineFactory",
    "PlanMismatch",
    "SyncError",
    "Transfer",
    "loading_label",
    "manifest_digest",
    "tensor_spec",
]


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
        plane = config.data_plane
        # gRPC cut through: a version's switch starts at its first bucket, not its last
        self._cut_through = plane.cut_through and not DATA_PLANES[plane.transport].broadcast
        self._switch_lock = asyncio.Lock()
        self._kept = KeptResources("sink")  # the Mooncake engine, started on first use
        self._tasks: set[asyncio.Task[Any]] = set()
        self.pull_tokens = MintedTokens()  # the engine workers' credentials, one per load
        self._routing = Routing(gateway, config.pause_mode)
        self._versions = Versions(config, metrics, spawn=self._spawn)
        self._loader = self._build_loader(metrics, engine_factory, advertise_target)
        self._membership = Membership(
            config,
            metrics,
            versions=self._versions,
            loader=self._loader,
            routing=self._routing,
            switch_lock=self._switch_lock,
            spawn=self._spawn,
        )

    def _build_loader(
        self,
        metrics: WeightSyncMetrics,
        engine_factory: EngineFactory,
        advertise_target: Callable[[], str],
    ) -> Loader:
        """Replica by replica (the workers pull) or all replicas at once (this service
        broadcasts), as the configured data plane delivers."""
        parts: dict[str, Any] = {
            "engine_factory": engine_factory,
            "routing": self._routing,
            "versions": self._versions,
            "advertise_target": advertise_target,
            "pull_tokens": self.pull_tokens,
        }
        if DATA_PLANES[self._config.data_plane.transport].broadcast:
            return BroadcastLoader(self._config, metrics, send=self._send_buckets, **parts)
        return PullLoader(self._config, metrics, **parts)

    def start(self) -> None:
        """Reconciles the configured replicas (nobody registers them): after a restart, each
        is brought to the committed version it may have missed."""
        self._membership.start()

    # -- what the servicer reads ----------------------------------------------------------

    @property
    def engines(self) -> dict[str, EngineEntry]:
        return self._membership.engines

    @property
    def transfers(self) -> dict[str, Transfer]:
        return self._versions.transfers

    @property
    def by_version(self) -> dict[int, Transfer]:
        return self._versions.by_version

    @property
    def committed(self) -> Transfer | None:
        return self._versions.committed

    @property
    def committed_version(self) -> int:
        return self._versions.committed_version

    @property
    def committed_id(self) -> str:
        """The transfer every serving replica holds ("" before the first commit)."""
        return self._versions.committed_id

    @property
    def _gateway(self) -> Any:
        return self._routing.gateway

    @_gateway.setter
    def _gateway(self, gateway: Any) -> None:
        """A gateway that replaced the previous one (a test's restarted gateway)."""
        self._routing.gateway = gateway

    def live_entries(self) -> list[EngineEntry]:
        return self._membership.live_entries()

    def plan_proto(self, transfer: Transfer) -> pb.BucketPlan:
        return self._versions.plan_proto(transfer)

    def transfer(self, transfer_id: str) -> Transfer:
        return self._versions.transfer(transfer_id)

    # -- what the senders and the gateway call --------------------------------------------

    def register_engine(
        self, replica_id: str, url: str, current_version: int, *, routed: bool = False
    ) -> bool:
        """Adds or refreshes a replica and reconciles it in the background (see
        `relayrl.weightsync.membership`); returns whether it is known not to hold the committed
        version."""
        return self._membership.register(replica_id, url, current_version, routed=routed)

    def publish(
        self,
        version: int,
        trainer_step: int,
        metas: Sequence[common_pb2.TensorMeta],
        *,
        supersede: bool = False,
        base_transfer_id: str = "",
    ) -> Transfer:
        """The plan of `version` (see `Versions.publish`)."""
        return self._versions.publish(
            version, trainer_step, metas, supersede=supersede, base_transfer_id=base_transfer_id
        )

    def put_bucket(
        self,
        transfer_id: str,
        index: int,
        data: bytes,
        sha256: str,
        *,
        delta: bool = False,
        shm: bool = False,
    ) -> None:
        """Keeps one pushed bucket (`delta`: a delta of its base's; `shm`: in the transfer's
        shared-memory slot). The last one of a transfer starts its switch -- or, cut through,
        the first one: the workers then pull each bucket as it arrives."""
        transfer = self._versions.transfer(transfer_id)
        first = transfer.state == pb.TRANSFER_STATE_PLANNED
        completed = self._versions.put_bucket(
            transfer_id, index, data, sha256, delta=delta, shm=shm
        )
        if first if self._cut_through else completed:
            self._spawn(self._switch(transfer))

    async def bucket(self, transfer: Transfer, index: int) -> bytes:
        """Bucket `index` of `transfer` as soon as it is here (see `Versions.bucket`)."""
        return await self._versions.bucket(transfer, index)

    # -- the switch -----------------------------------------------------------------------

    async def _switch(self, transfer: Transfer) -> None:
        async with self._switch_lock:  # one version switch (or reconciliation) at a time
            live = self._membership.live_entries()
            transfer.replica_ids = [e.replica_id for e in live]
            transfer.state = pb.TRANSFER_STATE_LOADING
            start = time.monotonic()
            try:
                paused = await self._routing.pause_all()
            except Exception as exc:
                self._versions.fail(transfer, SyncError("switch", f"pausing rollout failed: {exc}"))
                await self._after_failed_switch(live)
                return
            try:
                loaded = await self._load_and_commit(transfer, live, paused)
            except Exception as exc:
                if not transfer.failed:  # else it failed on its own (its push), and said why
                    error = exc if isinstance(exc, SyncError) else SyncError("load", repr(exc))
                    self._versions.fail(transfer, error)
                await self._after_failed_switch(live)
                return
            finally:
                self._versions.observe(transfer, "pause_window", time.monotonic() - start)
            await self._membership.resume(loaded, transfer.version)

    async def _load_and_commit(
        self, transfer: Transfer, live: list[EngineEntry], paused: Sequence[str]
    ) -> list[str]:
        """Loads `transfer` into the live replicas and commits it; the replicas that loaded
        it. SyncError when every replica that answered refused it, or it cannot be kept."""
        # Replicas the gateway did not pause (not routed to: joining, or after a failed
        # load) are paused at the engine, so none computes during its load.
        unpaused = {e.replica_id for e in live} - set(paused)
        staged = self._versions.stage(transfer)  # to disk while the replicas load
        try:
            outcomes = await self._loader.load(
                live, transfer, restore=self._routing.drives_engines, pause_engine=unpaused
            )
            await self._versions.arrived(transfer)  # cut through, the push may still run
            loaded = [e.replica_id for e in live if outcomes[e.replica_id] == LOADED]
            refused = [e.replica_id for e in live if outcomes[e.replica_id] == REFUSED]
            transfer.replica_ids = loaded
            if refused and not loaded:
                raise SyncError(
                    "load",
                    f"no replica loaded version {transfer.version} "
                    f"({', '.join(refused)} answered but could not load it)",
                )
            await self._versions.commit(transfer, staged)
        except BaseException:
            await self._versions.unstage(transfer, staged)
            raise
        return loaded

    async def _after_failed_switch(self, live: list[EngineEntry]) -> None:
        """The previous version stays committed: replicas that still hold it go back to
        routing; the others (they hold a mix, or the version that failed) are held out of it
        until a reconciliation reloads them, so no other resume (a colocated trainer's) can
        route to them either."""
        good = [e.replica_id for e in live if e.holds == self.committed_id]
        await self._membership.resume(good, self.committed_version)
        for entry in live:
            if entry.holds != self.committed_id and not entry.failed:
                entry.routed = False
                await self._routing.hold(entry)

    def _send_buckets(self, spec: TransportSpec, transfer: Transfer) -> None:
        """This service as the only sender of `spec` (runs in a thread)."""
        import torch

        from relayrl.dataplane.transports.base import open_sink

        with open_sink(spec, 0, **self._kept.for_spec(spec)) as sink, warnings.catch_warnings():
            # The buckets are immutable bytes; the data plane only reads them.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for index in range(spec.num_buckets):
                data = transfer.buckets[index]
                if data is None:
                    raise SyncError(
                        "transport", f"bucket {index} of {transfer.transfer_id} is gone"
                    )
                sink.send(index, torch.frombuffer(data, dtype=torch.uint8))

    # -- bookkeeping ----------------------------------------------------------------------

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._kept.close()
        self._versions.close()
