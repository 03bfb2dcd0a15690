"""Loading a transfer into replicas, with retries, over the configured data plane: the `load`
boundary (and `restore`, when no gateway drives the switch).

How weight-sync delivers depends on the data plane (`relayrl.dataplane.data_planes`): over the
gRPC pull each replica's workers fetch the buckets themselves, so replicas load independently,
each with its own tries (`PullLoader`); over a broadcast data plane one attempt sends every
bucket once to every worker of the pending replicas, and the replicas that failed it go again
together (`BroadcastLoader`). Either way a replica that spends its attempts is held out of
routing until a reconciliation loads a whole version into it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from relayrl.core.access import ENGINE
from relayrl.core.interceptors import MintedTokens
from relayrl.core.ports import free_port
from relayrl.dataplane.request import ReceiveRequest
from relayrl.dataplane.transports.base import TransportSpec
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.versions import SyncError, Transfer, Versions

if TYPE_CHECKING:
    from relayrl.weightsync.membership import EngineEntry
    from relayrl.weightsync.routing import Routing

logger = logging.getLogger(__name__)

_PING_TIMEOUT_S = 10.0
_ANSWER_AFTER_FAILURE_S = 10.0
_TOKEN_GRACE_S = 30.0  # a pull token outlives the load's deadline by this much at most

LOADED, REFUSED, UNREACHABLE = "loaded", "refused", "unreachable"
"""How a replica ended a version: it holds it; it answers but could not load it; it is gone."""

# The engine-side calls the coordinator makes; `VllmEngineClient` in production, anything with
# these coroutines in a test of the logic.
EngineFactory = Callable[[str, float], Any]


def loading_label(version: int) -> str:
    """The engine's weight-version label while a version loads: not a version, so nothing
    that reads the label (spans, evaluation, an operator) takes a half-loaded model for one."""
    return f"loading-{version}"


class Loader(abc.ABC):
    def __init__(
        self,
        config: WeightSyncConfig,
        metrics: WeightSyncMetrics,
        *,
        engine_factory: EngineFactory,
        routing: Routing,
        versions: Versions,
        advertise_target: Callable[[], str],
        pull_tokens: MintedTokens | None = None,
    ) -> None:
        """`pull_tokens`: where the tokens handed to the engine workers for one load are
        minted (the service's authenticator accepts them until the load ends)."""
        self._config = config
        self._metrics = metrics
        self._engine_factory = engine_factory
        self._routing = routing
        self._versions = versions
        self._advertise_target = advertise_target
        self._pull_tokens = pull_tokens if pull_tokens is not None else MintedTokens()

    @abc.abstractmethod
    async def load(
        self,
        entries: list[EngineEntry],
        transfer: Transfer,
        *,
        restore: bool,
        pause_engine: set[str],
    ) -> dict[str, str]:
        """Load `transfer` into `entries`, with retries; the outcome of each replica (LOADED,
        REFUSED, UNREACHABLE). With `restore` each replica is paused, restored and resumed at
        its engine (no gateway drives the switch); replicas in `pause_engine` are paused at
        their engine first (the gateway did not pause them)."""

    async def holds(self, entry: EngineEntry) -> str | None:
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

    def _retry_delay_s(self, attempt: int) -> float:
        """The wait before try `attempt` (2, 3, ...) of a replica."""
        return self._config.engines.retry_backoff_s * 2 ** (attempt - 2)

    def _request(
        self,
        entry: EngineEntry,
        transfer: Transfer,
        spec: TransportSpec | None = None,
        receiver_rank_base: int | None = None,
    ) -> ReceiveRequest:
        """What `entry`'s workers receive; `spec` and `receiver_rank_base` for a broadcast. Its
        token is good for the engine role until `_receive` ends (or the load's deadline)."""
        timeout_s = self._config.engines.load_timeout_s
        return ReceiveRequest(
            transport=self._config.data_plane.transport,
            target=self._advertise_target(),
            transfer_id=transfer.transfer_id,
            plan_digest=transfer.plan_digest,
            replica_id=entry.replica_id,
            timeout_s=timeout_s,
            spec=spec,
            receiver_rank_base=receiver_rank_base,
            bucket_sha256=tuple(transfer.sha256) if spec is not None else (),
            token=self._pull_tokens.mint(ENGINE, timeout_s + _TOKEN_GRACE_S),
            tls=self._config.grpc.tls is not None,
        )

    async def _receive(
        self,
        client: Any,
        entry: EngineEntry,
        transfer: Transfer,
        request: ReceiveRequest,
        *,
        restore: bool,
        pause_engine: bool = False,
    ) -> None:
        """One replica receives and loads `transfer` as `request` says and every worker's
        checksums are checked. The replica is paused at the engine first with `restore` (no
        gateway drives the switch) or `pause_engine` (the gateway did not pause it); with
        `restore` it is also restored here. While it loads its label says so
        (`loading_label`): a half-loaded model never carries a version."""
        start = time.monotonic()
        if restore or pause_engine:
            await client.pause(self._config.pause_mode)
        entry.holds = None  # from here until it answers, the replica may hold a mix
        await client.set_weight_version(loading_label(transfer.version))
        try:
            answers = await client.worker_rpc("relayrl_receive", request.to_dict())
        finally:
            self._pull_tokens.revoke(request.token)
        for answer in answers:
            if answer.get("bucket_sha256") != transfer.sha256:
                raise SyncError("load", "a worker loaded buckets whose checksums differ")
        self._versions.observe(transfer, "load", time.monotonic() - start)
        if restore:  # a replica that fails above stays paused until a retry loads it
            start = time.monotonic()
            await client.reset_prefix_cache()
            await client.set_weight_version(str(transfer.version))
            await client.resume()
            self._versions.observe(transfer, "restore", time.monotonic() - start)

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

    async def _give_up(self, entry: EngineEntry) -> str:
        """The replica spent its attempts: out of switches (and of routing: the gateway is
        never told to resume it) until a reconciliation loads a whole version into it.
        Whether it still answers tells a refusal from a death."""
        entry.failed, entry.holds, entry.routed = True, None, False
        await self._routing.hold(entry)
        answers = await self.holds(entry)
        outcome = UNREACHABLE if answers == UNREACHABLE else REFUSED
        logger.warning(
            "replica %s is out of routing until it is reloaded (%s: %s)",
            entry.replica_id, outcome, entry.last_error,
        )  # fmt: skip
        return outcome


class PullLoader(Loader):
    """gRPC data plane: each replica's workers pull the buckets; replicas load independently,
    each with its own retries."""

    async def load(
        self,
        entries: list[EngineEntry],
        transfer: Transfer,
        *,
        restore: bool,
        pause_engine: set[str],
    ) -> dict[str, str]:
        outcomes = await asyncio.gather(
            *(
                self._load_replica(
                    e, transfer, restore=restore, pause_engine=e.replica_id in pause_engine
                )
                for e in entries
            )
        )
        return {e.replica_id: o for e, o in zip(entries, outcomes, strict=True)}

    async def _load_replica(
        self, entry: EngineEntry, transfer: Transfer, *, restore: bool, pause_engine: bool
    ) -> str:
        settings = self._config.engines
        client = self._engine_factory(entry.url, settings.load_timeout_s)
        try:
            for attempt in range(1, settings.attempts + 1):
                if attempt > 1:
                    await asyncio.sleep(self._retry_delay_s(attempt))
                try:
                    request = self._request(entry, transfer)
                    await self._receive(
                        client, entry, transfer, request, restore=restore, pause_engine=pause_engine
                    )
                    self._loaded(entry, transfer)
                    return LOADED
                except Exception as exc:
                    self._attempt_failed(entry, transfer, attempt, exc)
                if transfer.failed:  # its push failed while the replica pulled: no retry
                    return REFUSED
            return await self._give_up(entry)
        finally:
            await client.close()


class BroadcastLoader(Loader):
    """Broadcast data plane: one attempt sends every bucket once to every worker of the pending
    replicas (`send` runs this service's sending side of a spec, in a thread); the replicas
    that failed it (a peer's death fails everyone's) go again, until they load or spend their
    attempts."""

    def __init__(
        self, *args: Any, send: Callable[[TransportSpec, Transfer], None], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._send = send

    async def load(
        self,
        entries: list[EngineEntry],
        transfer: Transfer,
        *,
        restore: bool,
        pause_engine: set[str],
    ) -> dict[str, str]:
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
            reachable = await self._count_reachable(entries, errors)
            if not reachable:
                return errors
            spec = self._spec(transfer, round_, sum(n for _, n in reachable))
            receiving = []
            base = 0
            for entry, count in reachable:
                request = self._request(entry, transfer, spec, receiver_rank_base=base)
                base += count
                receive = self._receive(
                    clients[entry.replica_id],
                    entry,
                    transfer,
                    request,
                    restore=restore,
                    pause_engine=entry.replica_id in pause_engine,
                )
                receiving.append(asyncio.ensure_future(receive))
            await self._send_while_receiving(spec, transfer, receiving)
            for (entry, _), task in zip(reachable, receiving, strict=True):
                error = _receive_error(task, spec)
                if error is not None:
                    errors[entry.replica_id] = error
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)
        return errors

    async def _count_reachable(
        self, entries: list[EngineEntry], errors: dict[str, Exception]
    ) -> list[tuple[EngineEntry, int]]:
        """The replicas that answer, each with its number of workers; the others go into
        `errors`."""
        counts = await asyncio.gather(
            *(self._count_workers(e.url) for e in entries), return_exceptions=True
        )
        reachable: list[tuple[EngineEntry, int]] = []
        for entry, count in zip(entries, counts, strict=True):
            if isinstance(count, BaseException):
                errors[entry.replica_id] = SyncError("load", f"replica unreachable: {count}")
            else:
                reachable.append((entry, count))
        return reachable

    async def _send_while_receiving(
        self, spec: TransportSpec, transfer: Transfer, receiving: Iterable[asyncio.Future[None]]
    ) -> None:
        """This service sends `spec` from a thread while the replicas receive; when the sending
        fails, a receiver that does not answer soon after is cancelled."""
        start = time.monotonic()
        sending = asyncio.ensure_future(asyncio.to_thread(self._send, spec, transfer))
        await asyncio.wait([sending])  # every wait of the sender has a deadline
        if sending.exception() is None:
            self._metrics.delivered.labels(spec.type).inc(spec.total_bytes * spec.num_receivers)
            self._metrics.delivery_rate.labels(spec.type).set(
                spec.total_bytes / max(time.monotonic() - start, 1e-9)
            )
            await asyncio.wait(receiving)  # loading the last buckets; the RPC's deadline
            return
        logger.warning(
            "%s: sending over %s failed: %s",
            transfer.transfer_id, spec.type, sending.exception(),
        )  # fmt: skip
        # Live receivers fail at once when the sender does; one that does not answer soon is
        # dead or stuck and must not hold up the retry of the others.
        _, stuck = await asyncio.wait(receiving, timeout=_ANSWER_AFTER_FAILURE_S)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)

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

    def _spec(self, transfer: Transfer, round_: int, receivers: int) -> TransportSpec:
        plane = self._config.data_plane
        host = plane.host or self._advertise_target().rpartition(":")[0].strip("[]")
        port = plane.rendezvous_port or free_port(host)
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


def _receive_error(task: asyncio.Future[None], spec: TransportSpec) -> Exception | None:
    """Why one replica's receive of `spec` failed, or None."""
    if task.cancelled():
        return SyncError(
            "load",
            f"no answer within {_ANSWER_AFTER_FAILURE_S:g} s after the "
            f"{spec.type} transfer failed (dead or stuck)",
        )
    error = task.exception()
    return error if isinstance(error, Exception) else None
