"""The pool of engine replicas the gateway routes to: health checks, sticky sessions, drain,
pause/resume across a weight-version change.

With weight-sync (`gated`), a replica enters routing only when weight-sync says it holds the
committed version: a new replica, one that comes back from being unhealthy (a restarted
engine holds its initial weights) and one whose load failed wait in LOADING, health-checked
and registered with weight-sync (gateway/registration.py), until a ResumeReplicas that names
a version. So no replica ever serves weights that are not committed. Without weight-sync a
healthy replica serves at once, with whatever weights it holds.

Routing is sticky by session (a trajectory, or a black-box agent's session): the first request
of a session picks the serving replica with the fewest requests in flight, and every later
request goes to the same replica while it serves (its prefix cache holds the conversation). A
replica that fails its health check `unhealthy_after` times in a row, or that an operator or
weight-sync drains, leaves routing; its sessions move on their next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from relayrl.gateway.metrics import GatewayMetrics
from relayrl.inference.client import EngineClient, EngineError, EngineUnavailable, PauseMode

logger = logging.getLogger(__name__)


class ReplicaState(enum.Enum):
    SERVING = "serving"
    PAUSED = "paused"
    LOADING = "loading"
    DRAINED = "drained"
    UNHEALTHY = "unhealthy"


class NoReplicaAvailable(Exception):
    """No replica is serving (all paused, drained or unhealthy)."""


@dataclass(eq=False)
class Replica:
    replica_id: str
    client: EngineClient
    source: str = "config"  # or "endpointslice"
    state: ReplicaState = ReplicaState.SERVING
    weight_version: str = ""
    num_inflight: int = 0
    num_failed_checks: int = 0
    last_error: str = ""
    sessions: set[str] = field(default_factory=set)

    @property
    def routable(self) -> bool:
        return self.state is ReplicaState.SERVING


class ReplicaPool:
    def __init__(
        self,
        *,
        health_interval_s: float = 5.0,
        unhealthy_after: int = 2,
        on_change: Callable[[Replica], None] | None = None,
        metrics: GatewayMetrics | None = None,
        gated: bool = False,
    ) -> None:
        """`gated`: a healthy replica waits in LOADING for weight-sync (see the module
        docstring) instead of serving at once."""
        self.gated = gated
        self.metrics = metrics or GatewayMetrics(CollectorRegistry())
        self._replicas: dict[str, Replica] = {}
        self._sessions: dict[str, Replica] = {}
        self._health_interval_s = health_interval_s
        self._unhealthy_after = unhealthy_after
        self._on_change = on_change or (lambda replica: None)
        self._routable = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._paused_at: dict[str, float] = {}

    # -- membership ----------------------------------------------------------------------

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, replica_id: str) -> Replica:
        try:
            return self._replicas[replica_id]
        except KeyError:
            known = ", ".join(sorted(self._replicas)) or "none"
            raise KeyError(f"unknown replica {replica_id!r} (known: {known})") from None

    async def add(self, replica_id: str, client: EngineClient, source: str = "config") -> Replica:
        """Register a replica; it serves once its first health check passes."""
        if replica_id in self._replicas:
            raise ValueError(f"replica {replica_id!r} is already registered")
        replica = Replica(replica_id, client, source, state=ReplicaState.UNHEALTHY)
        self._replicas[replica_id] = replica
        await self.check(replica)
        return replica

    async def remove(self, replica_id: str) -> None:
        """Forget a replica (its endpoint is gone); its sessions move on their next request."""
        replica = self._replicas.pop(replica_id, None)
        if replica is not None:
            self._forget_sessions(replica)
            self._refresh()
            await replica.client.close()

    # -- health --------------------------------------------------------------------------

    async def check(self, replica: Replica) -> None:
        healthy = await replica.client.health()
        if healthy:
            replica.num_failed_checks = 0
            if replica.state is ReplicaState.UNHEALTHY:
                with contextlib.suppress(EngineError):
                    replica.weight_version = await replica.client.weight_version()
                if self.gated:  # it may hold anything: weight-sync checks its weights first
                    self._set_state(
                        replica, ReplicaState.LOADING, "healthy; weight-sync checks its weights"
                    )
                else:
                    self._set_state(replica, ReplicaState.SERVING, "health check passed")
            return
        replica.num_failed_checks += 1
        if (
            replica.num_failed_checks >= self._unhealthy_after
            or replica.state is ReplicaState.UNHEALTHY
        ):
            self.mark_unhealthy(replica, "health check failed")

    def mark_unhealthy(self, replica: Replica, reason: str) -> None:
        if replica.state in (ReplicaState.DRAINED, ReplicaState.UNHEALTHY):
            return
        replica.last_error = reason
        self._set_state(replica, ReplicaState.UNHEALTHY, reason)
        self._forget_sessions(replica)

    def start_health_checks(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop(), name="replica-health")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await asyncio.gather(
                *(self.check(r) for r in self.replicas if r.state is not ReplicaState.DRAINED)
            )

    # -- routing -------------------------------------------------------------------------

    def pick(self, session_id: str) -> Replica:
        """The session's replica, or the least-loaded serving one for a new session."""
        replica = self._sessions.get(session_id)
        if replica is not None and replica.routable and replica.replica_id in self._replicas:
            return replica
        candidates = [r for r in self._replicas.values() if r.routable]
        if not candidates:
            raise NoReplicaAvailable(self._why_none())
        replica = min(candidates, key=lambda r: (r.num_inflight, len(r.sessions), r.replica_id))
        self._sessions[session_id] = replica
        replica.sessions.add(session_id)
        self.metrics.sessions.set(len(self._sessions))
        return replica

    async def wait_routable(self, timeout_s: float | None = None) -> None:
        """Wait until some replica serves (during a weight update, until resume)."""
        async with asyncio.timeout(timeout_s):
            await self._routable.wait()

    def end_session(self, session_id: str) -> None:
        replica = self._sessions.pop(session_id, None)
        if replica is not None:
            replica.sessions.discard(session_id)
        self.metrics.sessions.set(len(self._sessions))

    @contextlib.asynccontextmanager
    async def request(self, replica: Replica) -> AsyncIterator[Replica]:
        """Count a request in flight on `replica` for load balancing and status."""
        gauge = self.metrics.engine_inflight.labels(replica=replica.replica_id)
        replica.num_inflight += 1
        gauge.inc()
        try:
            yield replica
        finally:
            replica.num_inflight -= 1
            gauge.dec()

    # -- control (weight-sync boundaries 0 and 4, operators) ------------------------------

    def select(self, replica_ids: Sequence[str]) -> list[Replica]:
        return [self.get(rid) for rid in replica_ids] if replica_ids else self.replicas

    async def pause(self, replicas: Iterable[Replica], mode: PauseMode) -> list[Replica]:
        """Pauses the serving (or paused) ones among `replicas`; returns them. A replica that
        cannot be reached leaves routing as unhealthy instead of failing the others' pause:
        it computes nothing either way, and comes back through its health check."""
        paused = []
        for replica in replicas:
            if replica.state not in (ReplicaState.SERVING, ReplicaState.PAUSED):
                continue
            try:
                await replica.client.pause(mode)
            except EngineUnavailable as exc:
                self.mark_unhealthy(replica, f"pause failed: {exc}")
                continue
            self._paused_at.setdefault(replica.replica_id, time.monotonic())
            self._set_state(replica, ReplicaState.PAUSED, f"paused ({mode})")
            paused.append(replica)
        return paused

    async def resume(self, replicas: Iterable[Replica], version: str | None) -> list[Replica]:
        """Label the new weights, drop KV computed by the old ones, route again. A LOADING
        replica is resumed only with a version: weight-sync's word that it holds it."""
        resumed = []
        for replica in replicas:
            if replica.state is ReplicaState.LOADING and version is None:
                continue
            if replica.state not in (ReplicaState.PAUSED, ReplicaState.LOADING):
                continue
            if version is not None:
                await replica.client.set_weight_version(version)
                replica.weight_version = version
            await replica.client.reset_prefix_cache()
            self.metrics.prefix_cache_resets.labels(replica=replica.replica_id).inc()
            await replica.client.resume()
            paused_at = self._paused_at.pop(replica.replica_id, None)
            if paused_at is not None:
                self.metrics.pause_duration.observe(time.monotonic() - paused_at)
            self._set_state(replica, ReplicaState.SERVING, f"resumed at version {version}")
            resumed.append(replica)
        return resumed

    def drain(self, replica: Replica, reason: str, *, until_loaded: bool = False) -> int:
        """Take `replica` out of routing for good (until re-added), or with `until_loaded`
        until weight-sync resumes it at a version; returns its sessions."""
        num_sessions = len(replica.sessions)
        replica.last_error = reason
        if until_loaded:
            if replica.state is not ReplicaState.DRAINED:
                self._set_state(replica, ReplicaState.LOADING, reason)
        else:
            self._set_state(replica, ReplicaState.DRAINED, reason)
        self._forget_sessions(replica)
        return num_sessions

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.close()

    # -- internals -----------------------------------------------------------------------

    def _set_state(self, replica: Replica, state: ReplicaState, reason: str) -> None:
        if replica.state is not state:
            logger.info(
                "replica %s: %s -> %s (%s)",
                replica.replica_id,
                replica.state.value,
                state.value,
                reason,
            )
            replica.state = state
            self._on_change(replica)
        up = self.metrics.replica_up.labels(replica=replica.replica_id)
        up.set(1 if replica.routable else 0)
        self._refresh()

    def _refresh(self) -> None:
        if any(r.routable for r in self._replicas.values()):
            self._routable.set()
        else:
            self._routable.clear()

    def _forget_sessions(self, replica: Replica) -> None:
        for session_id in replica.sessions:
            self._sessions.pop(session_id, None)
        replica.sessions.clear()

    def _why_none(self) -> str:
        if not self._replicas:
            return "no engine replica is registered"
        states = ", ".join(f"{r.replica_id}={r.state.value}" for r in self._replicas.values())
        return f"no engine replica is serving ({states})"
