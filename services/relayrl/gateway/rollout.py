"""The rollout loop: claim prompt groups from the TransferQueue under the staleness throttle,
roll out every missing sample on a sticky engine replica, write each trajectory back as soon
as it is done (so the reward-service can score it while the rest of the group samples).

Throttle (docs/staleness.md#rollout-throttle): with the trainer at step v and B groups per step,
the gateway keeps launched < (v + 1 + η)·B, counted partition-wide by the TransferQueue itself
so several gateways cannot overshoot together. η = 0 is synchronous: the next step's rollouts
start only once the trainer has taken this step's.

Failures are never a reward of 0: an engine that dies or times out mid-rollout, or a tool
that crashes, yields a trajectory put as `failed` (is_infra) with the reason; the trainer keeps
it out of the group baseline and the prompt feeder refills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from relayrl.conversation.tools import ToolFailure
from relayrl.core.logs import REQUEST_ID
from relayrl.gateway.agents import AgentContext, AgentLoop
from relayrl.gateway.engine_session import (
    EngineTimeout,
    StickySession,
    failed_trajectory,
    trajectory_of,
)
from relayrl.gateway.external_agent import ExternalAgent
from relayrl.gateway.replicas import NoReplicaAvailable, ReplicaPool
from relayrl.inference.client import (
    EngineError,
)
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import AsyncTransferQueue, ClaimedGroup, TrajectoryPut
from relayrl.tq.errors import StaleClaimError, TQError
from relayrl.tq.queue import TQUnavailableError

logger = logging.getLogger(__name__)

# The claim loop is woken by new pending groups (see _PendingWatcher); this poll is only the
# fallback for a missed wake-up.
IDLE_POLL_S = 1.0
WATCH_BLOCK_MS = 1000
# Expired claims are swept at least this often (see LeaseSweeper).
SWEEP_MAX_INTERVAL_S = 5.0


@dataclass
class Throttle:
    """launched < (policy_step + 1 + eta) * batch_size + refill_groups, in prompt groups.

    `refill_groups` are the trainer's replacements for groups it evicted (too stale), filtered
    (no signal) or lost to infrastructure failures: without them the launched counter, which
    never goes down for consumed groups, would stop rollout short of a full batch."""

    policy_step: int = 0
    batch_size: int = 8
    eta: int = 0
    refill_groups: int = 0

    @property
    def max_launched(self) -> int:
        return int((self.policy_step + 1 + self.eta) * self.batch_size) + self.refill_groups


class RolloutWorker:
    """One gateway's rollout loop on one partition."""

    def __init__(
        self,
        tq: AsyncTransferQueue,
        pool: ReplicaPool,
        loops: Mapping[str, AgentLoop | ExternalAgent],
        context_for: Callable[[common_pb2.PromptGroup, int], AgentContext],
        *,
        partition: str,
        claimer: str,
        throttle: Throttle,
        lease_s: float,
        max_inflight_groups: int,
        request_timeout_s: float,
        default_agent: str = "single_turn",
    ) -> None:
        self._tq = tq
        self._pool = pool
        self._loops = loops
        self._context_for = context_for
        self.partition = partition
        self._claimer = claimer
        self.throttle = throttle
        self._lease_s = lease_s
        self._max_inflight_groups = max_inflight_groups
        self._request_timeout_s = request_timeout_s
        self._default_agent = default_agent
        self._groups: dict[str, asyncio.Task[None]] = {}
        self._claims: dict[str, ClaimedGroup] = {}  # of the groups in `_groups`
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: _PendingWatcher | None = None
        self.num_launched = 0
        self.counts = {"finished": 0, "failed": 0}

    @property
    def num_inflight_groups(self) -> int:
        return len(self._groups)

    def update_policy_step(
        self, policy_step: int, batch_size: int | None = None, refill_groups: int | None = None
    ) -> None:
        self.throttle.policy_step = policy_step
        if batch_size:
            self.throttle.batch_size = batch_size
        if refill_groups is not None:
            self.throttle.refill_groups = refill_groups
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._claim_loop(), name=f"rollout-{self.partition}")
        self._watcher = _PendingWatcher(self._tq, self.partition, self._wake)
        self._watcher.start()

    async def _claim_loop(self) -> None:
        await self._release_predecessors()
        while True:
            self._wake.clear()
            free = self._max_inflight_groups - len(self._groups)
            claimed: list[ClaimedGroup] = []
            if free > 0:
                try:
                    result = await self._tq.claim_groups(
                        self.partition,
                        max_groups=free,
                        claimer=self._claimer,
                        lease_s=self._lease_s,
                        max_launched=self.throttle.max_launched,
                    )
                    claimed, self.num_launched = result.claimed, result.num_launched
                except TQError as exc:
                    logger.warning("claiming from %s failed: %s", self.partition, exc)
            self._record_claims(claimed)
            for claim in claimed:
                task = asyncio.create_task(self._run_group(claim))
                self._groups[claim.group.uid] = task
                self._claims[claim.group.uid] = claim
                task.add_done_callback(lambda _, uid=claim.group.uid: self._group_done(uid))
            if not claimed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_POLL_S):
                        await self._wake.wait()

    async def _release_predecessors(self) -> None:
        """Groups still claimed under this gateway's name were left by a process of it that
        died (a restart, a SIGKILL): back to pending now, not when their leases expire."""
        reason = "released by a restarted claimer"
        try:
            released = await self._tq.release_claimer(self.partition, self._claimer, reason)
        except TQError as exc:
            logger.warning(
                "could not give back what an earlier %s left claimed on %s (%s); its leases "
                "will expire",
                self._claimer,
                self.partition,
                exc,
            )
            return
        if released:
            logger.info(
                "gave back %d groups an earlier %s left claimed on %s: %s",
                len(released),
                self._claimer,
                self.partition,
                ", ".join(released[:5]) + (", ..." if len(released) > 5 else ""),
            )

    def _record_claims(self, claimed: list[ClaimedGroup]) -> None:
        metrics, partition = self._pool.metrics, self.partition
        metrics.groups_launched.labels(partition=partition).set(self.num_launched)
        metrics.max_launched.labels(partition=partition).set(self.throttle.max_launched)
        metrics.groups_inflight.labels(partition=partition).set(len(self._groups) + len(claimed))
        for claim in claimed:
            staleness = max(0, self.throttle.policy_step - claim.group.prompt_step)
            metrics.launch_staleness.labels(partition=partition).observe(staleness)

    def _group_done(self, uid: str) -> None:
        self._groups.pop(uid, None)
        self._claims.pop(uid, None)
        self._pool.metrics.groups_inflight.labels(partition=self.partition).set(len(self._groups))
        self._wake.set()

    async def _run_group(self, claim: ClaimedGroup) -> None:
        renewer = asyncio.create_task(self._renew(claim))
        try:
            await asyncio.gather(*(self._run_sample(claim, i) for i in claim.missing_indices))
        except StaleClaimError:
            logger.warning(
                "lost the claim on %s/%s; another gateway owns it now",
                self.partition,
                claim.group.uid,
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception(
                "rolling out %s/%s failed; releasing it", self.partition, claim.group.uid
            )
            with contextlib.suppress(TQError):
                await self._tq.release_groups(self.partition, [claim], "gateway error")
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    async def _renew(self, claim: ClaimedGroup) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            with contextlib.suppress(TQError):
                await self._tq.renew_leases(self.partition, [claim], self._lease_s)

    async def _run_sample(self, claim: ClaimedGroup, index: int) -> None:
        group = claim.group
        session_id = f"{group.uid}_{index}"
        # Every log line of this rollout carries its session id (each sample runs in a task of
        # its own, so the context variable is this rollout's alone); engine request ids are
        # derived from it too.
        REQUEST_ID.set(session_id)
        started = time.time()
        loop = self._loops.get(group.agent or self._default_agent)
        if isinstance(loop, ExternalAgent):
            # the agent's session puts its trajectory; a failure it could not put is put here
            run = await loop.run_sample(claim, index)
            failed = not run.finished
            if run.needs_put:
                trajectory = failed_trajectory(group, index, run.reason)
                await self._put(claim, TrajectoryPut(trajectory, claim.claim_id, failed=True))
        else:
            try:
                trajectory = await self._rollout(loop, group, index, session_id, started)
                failed = False
            except (EngineError, EngineTimeout, ToolFailure, NoReplicaAvailable) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                logger.warning("rollout %s failed (infrastructure): %s", session_id, reason)
                trajectory, failed = failed_trajectory(group, index, reason), True
            finally:
                self._pool.end_session(session_id)
            await self._put(claim, TrajectoryPut(trajectory, claim.claim_id, failed=failed))
        outcome = "failed" if failed else "finished"
        self.counts[outcome] += 1
        metrics = self._pool.metrics
        metrics.rollouts.labels(partition=self.partition, outcome=outcome).inc()
        metrics.rollout_duration.labels(partition=self.partition, outcome=outcome).observe(
            time.time() - started
        )

    async def _put(self, claim: ClaimedGroup, put: TrajectoryPut) -> None:
        """Writes a finished rollout, waiting out a Redis restart for as long as the claim's
        lease (the put is idempotent; past the lease the claim belongs to someone else)."""
        deadline = time.monotonic() + self._lease_s
        delay_s = 0.5
        while True:
            try:
                await self._tq.put_trajectories(self.partition, [put])
                return
            except TQUnavailableError as exc:
                if time.monotonic() + delay_s > deadline:
                    raise
                logger.warning(
                    "writing %s/%s_%d waits for the TransferQueue: %s",
                    self.partition, claim.group.uid, put.trajectory.index, exc,
                )  # fmt: skip
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    async def _rollout(
        self,
        loop: AgentLoop | None,
        group: common_pb2.PromptGroup,
        index: int,
        session_id: str,
        started: float,
    ) -> common_pb2.Trajectory:
        if loop is None:
            raise ToolFailure(
                f"group {group.uid} asks for agent loop {group.agent!r}, which this gateway "
                f"does not have (known: {', '.join(sorted(self._loops))})"
            )
        session = StickySession(self._pool, session_id, self._request_timeout_s)
        rollout = await loop.run(group, session, self._context_for(group, index))
        trajectory = trajectory_of(group, index, rollout, started)
        for span in trajectory.spans:
            if span.generated and not span.replica:
                span.replica = session.replica_id
        return trajectory

    async def close(self) -> None:
        """Stop claiming; cancel the running groups and give their claims back (running ->
        pending, keeping the trajectories already written), so that whoever claims next, a
        resumed run included, takes them at once instead of waiting out their leases. A claim
        that cannot be given back (Redis away) expires as a killed gateway's does."""
        if self._watcher is not None:
            await self._watcher.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        claims = list(self._claims.values())
        for task in list(self._groups.values()):
            task.cancel()
        await asyncio.gather(*self._groups.values(), return_exceptions=True)
        if claims:
            released = await self._release(claims)
            logger.info(
                "stopping: gave back %d of %d groups in flight on %s",
                released,
                len(claims),
                self.partition,
            )

    async def _release(self, claims: list[ClaimedGroup]) -> int:
        """Gives each claim back on its own: one that finished or was superseded meanwhile
        (its last trajectory landed as the task was cancelled) must not keep back the rest."""
        released = 0
        for claim in claims:
            try:
                released += await self._tq.release_groups(
                    self.partition, [claim], "gateway stopped"
                )
            except StaleClaimError:
                continue  # no longer ours to give back
            except TQUnavailableError as exc:  # Redis away: every lease will expire
                logger.warning(
                    "could not give back %d groups on %s (%s); their leases will expire",
                    len(claims) - released,
                    self.partition,
                    exc,
                )
                break
            except TQError as exc:
                logger.warning(
                    "could not give back %s/%s (%s); its lease will expire",
                    self.partition,
                    claim.group.uid,
                    exc,
                )
        return released


class LeaseSweeper:
    """Returns groups whose claim lease expired to pending, on every partition this gateway
    serves. A gateway that dies (SIGKILL, node loss) leaves its groups `running` with a lease
    nobody renews; without a sweep they would stay there, counted as launched by the throttle,
    and a trainer waiting for them would wait forever. Every gateway sweeps: the requeue is
    one atomic script, so two sweepers cannot requeue a group twice, and a group whose
    claimer is alive is never touched (it renews every lease_s / 3)."""

    def __init__(
        self,
        tq: AsyncTransferQueue,
        partitions: Sequence[str],
        lease_s: float,
        on_requeued: Callable[[str, list[str]], None],
    ) -> None:
        self._tq = tq
        self._partitions = list(dict.fromkeys(partitions))
        # an expired lease is found within a quarter lease (at most SWEEP_MAX_INTERVAL_S)
        self.interval_s = max(0.05, min(lease_s / 4, SWEEP_MAX_INTERVAL_S))
        self._on_requeued = on_requeued
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="lease-sweeper")

    async def sweep_once(self) -> None:
        for partition in self._partitions:
            try:
                uids = await self._tq.requeue_expired(partition)
            except TQError as exc:
                logger.warning("requeueing expired claims on %s failed: %s", partition, exc)
                continue
            if uids:
                self._on_requeued(partition, uids)

    async def _run(self) -> None:
        while True:
            await self.sweep_once()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _PendingWatcher:
    """Wakes the claim loop the moment a group becomes pending (put, released, requeued,
    reissued), instead of letting a synchronous step wait out a poll interval: a task of its own
    blocks on the partition's event stream, on a pooled connection of its own (the asyncio
    client's), while the loop's other commands use theirs."""

    def __init__(self, tq: AsyncTransferQueue, partition: str, wake: asyncio.Event) -> None:
        self._tq = tq
        self._partition = partition
        self._wake = wake
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pending-watch-{self._partition}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        last_id = "$"
        while True:
            try:
                last_id, pending = await self._tq.wait_for_pending(
                    self._partition, last_id, block_ms=WATCH_BLOCK_MS
                )
            except (TQError, redis.RedisError):
                await asyncio.sleep(1.0)  # Redis away: the claim loop's poll still runs
                continue
            if pending:
                self._wake.set()
