"""The replicas a version goes to, and late joiners.

Each replica has the id the gateway gives it (a pod name, or engine-<index> for a configured
URL list: relayrl.core.replicas). The gateway registers every healthy replica every few
seconds; a registration is also a reconciliation: under the switch lock, the replica's workers
are asked which weights they hold whole (`relayrl_ping`), and a replica that does not hold the
committed transfer is loaded with it before the gateway may route to it (ResumeReplicas with
the committed version is the only way a replica enters routing). A new engine, a restarted
one, one that failed a load half-way and one that a restarted gateway finds all go through the
same path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.core.replicas import static_replica_ids
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.loading import LOADED, UNREACHABLE, Loader
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.routing import Routing
from relayrl.weightsync.versions import Versions

logger = logging.getLogger(__name__)

_MAX_RECONCILE_BACKOFF_S = 30.0


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


class Membership:
    """The replicas weight-sync knows (`engines`, by replica id) and their reconciliation.
    `switch_lock` is the coordinator's: one version switch or reconciliation at a time;
    `spawn` runs a background coroutine under the coordinator's care."""

    def __init__(
        self,
        config: WeightSyncConfig,
        metrics: WeightSyncMetrics,
        *,
        versions: Versions,
        loader: Loader,
        routing: Routing,
        switch_lock: asyncio.Lock,
        spawn: Callable[[Awaitable[Any]], None],
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._versions = versions
        self._loader = loader
        self._routing = routing
        self._switch_lock = switch_lock
        self._spawn = spawn
        self.engines: dict[str, EngineEntry] = {
            replica_id: EngineEntry(replica_id, url)
            for replica_id, url in static_replica_ids(config.engines.urls).items()
        }

    def start(self) -> None:
        """Reconciles the configured replicas (nobody registers them): after a restart, each
        is brought to the committed version it may have missed."""
        for entry in self.engines.values():
            self._schedule_reconcile(entry)

    def live_entries(self) -> list[EngineEntry]:
        now, ttl = time.monotonic(), self._config.engines.registration_ttl_s
        return [e for e in self.engines.values() if e.live(now, ttl)]

    def register(
        self, replica_id: str, url: str, current_version: int, *, routed: bool = False
    ) -> bool:
        """Adds or refreshes a replica and reconciles it in the background; returns whether
        it is known not to hold the committed version."""
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
        return entry.failed or entry.holds != self._versions.committed_id

    async def resume(self, replica_ids: Sequence[str], version: int) -> None:
        """The gateway routes to `replica_ids` again, labelled `version` (a replica it no
        longer knows is skipped)."""
        for replica_id in replica_ids:
            if await self._routing.resume(replica_id, version):
                self.engines[replica_id].routed = True

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
        holds = await self._loader.holds(entry)
        if holds == UNREACHABLE:
            entry.last_error = "unreachable"
            return False
        versions = self._versions
        target = versions.committed
        if holds == versions.committed_id:
            entry.holds, entry.version, entry.failed = holds, versions.committed_version, False
            self._metrics.replica_version.labels(entry.replica_id).set(entry.version)
            if not entry.routed:
                await self.resume([entry.replica_id], versions.committed_version)
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
        await self._routing.pause([entry.replica_id])  # out of routing while it loads
        outcomes = await self._loader.load(
            [entry],
            target,
            restore=self._routing.drives_engines,
            pause_engine={entry.replica_id},
        )
        if outcomes[entry.replica_id] != LOADED:
            return False
        logger.info("late joiner %s reached version %d", entry.replica_id, target.version)
        await self.resume([entry.replica_id], target.version)
        return True
