"""weight-sync's say in which replicas the gateway routes to: paused for a switch, resumed at a
version once they hold it, held out of routing when they may hold a mix of two versions.

The gateway is `GatewayControl` (relayrl.weightsync.server) in production, anything with its
coroutines in a test; without one, weight-sync drives the engines directly (it pauses and
restores each replica at the engine itself) and every call here does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relayrl.weightsync.membership import EngineEntry

logger = logging.getLogger(__name__)


class Routing:
    def __init__(self, gateway: Any, pause_mode: str) -> None:
        self.gateway = gateway
        """Replaced when the gateway is (a test's restarted gateway)."""
        self._pause_mode = pause_mode

    @property
    def drives_engines(self) -> bool:
        """No gateway: weight-sync pauses, relabels and resumes each replica at its engine."""
        return self.gateway is None

    async def pause_all(self) -> list[str]:
        """The gateway pauses the replicas it routes to; which ones it paused."""
        if self.gateway is None:
            return []
        return list(await self.gateway.pause(self._pause_mode))

    async def pause(self, replica_ids: Sequence[str]) -> None:
        """The gateway takes `replica_ids` out of routing, whatever they were doing."""
        if self.gateway is not None:
            await self.gateway.pause(self._pause_mode, list(replica_ids))

    async def resume(self, replica_id: str, version: int) -> bool:
        """The gateway routes to `replica_id` again, labelled `version`; False when it did not
        (no gateway, or one that no longer knows the replica). A failure is logged: the replica
        stays out of routing, and its next registration reconciles it."""
        if self.gateway is None:
            return False
        try:
            return bool(await self.gateway.resume(replica_id, version))
        except Exception as exc:
            logger.warning(
                "could not resume replica %s at version %d: %s", replica_id, version, exc
            )
            return False

    async def hold(self, entry: EngineEntry) -> None:
        """The gateway keeps `entry` out of routing until a resume names a version."""
        if self.gateway is None:
            return
        try:
            await self.gateway.hold(
                entry.replica_id, entry.last_error or "not at the committed version"
            )
        except Exception as exc:  # it is paused at the engine, and we never resume it
            logger.warning("could not hold replica %s: %s", entry.replica_id, exc)
