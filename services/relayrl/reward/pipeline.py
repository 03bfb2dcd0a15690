"""The reward pipeline (docs/rewards.md#submit-and-collect): submissions enter a bounded
backlog, one lane per manager turns them into backend calls, results come back in input order.

    submit(items) -> Handle          validation, back-pressure, then queued in the lane
    lane: chunk or micro-batch  ->   manager.score_batch(items)   (at most max_inflight at once)
    wait(handle) / collect(handle)   results re-ordered by item id, statuses never a silent 0

How a lane forms calls (`BatchingConfig`):
- micro-batching off (`micro_batch_size: 0`): each submission is split into
  min(num_workers, n) chunks and each chunk is one call, at most `num_workers` calls at once.
  A submission smaller than the worker count therefore degenerates to per-item calls, exactly
  as the reference benchmark measured (docs/rewards.md#reference-benchmark).
- micro-batching on: items from every submission wait together; a call is sent when
  `micro_batch_size` items are waiting or the oldest has waited `micro_batch_timeout_ms`, with
  up to `max_inflight_calls` calls at once. Items streamed one at a time thus reach the backend
  as few large requests (docs/rewards.md#micro-batching).
- group-aware managers (gdpo) get whole groups in one call: items that carry
  `extra.group_size` wait in a gate until their group is complete (or `group_timeout_s`
  passes: TIMEOUT); otherwise a group is the items of one submission sharing `group_id`.

Back-pressure is counted in items (accepted and not yet finished): `block` makes submit wait
for room (up to the caller's deadline), `drop_oldest` evicts the oldest queued items, which come
back RATE_LIMITED (never dropped silently, never a 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from relayrl.reward.items import (
    InfraError,
    InvalidItem,
    RateLimited,
    RewardItem,
    RewardResult,
    ScoringTimeout,
    token_level_scores,
)
from relayrl.reward.lanes import Entry, Lane, SubmitOptions, error_result, settle
from relayrl.reward.managers.base import BatchingConfig, RewardManager
from relayrl.reward.metrics import RewardMetrics

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 5.0


# --- errors a caller can cause ---------------------------------------------------------------


class RequestError(Exception):
    """A request the pipeline refuses as a whole; the front door maps it to a status code."""


class InvalidRequest(RequestError):
    """Malformed request (INVALID_ARGUMENT); the message names the field."""


class UnknownHandle(RequestError):
    """No such handle (NOT_FOUND): never issued, expired, or collected long ago."""


class ManagerNotAllowed(RequestError):
    """The tenant may not use this manager (PERMISSION_DENIED)."""


class Overloaded(RequestError):
    """No room in the backlog before the deadline (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Closing(RequestError):
    """The service is shutting down (UNAVAILABLE): retry on another replica."""


# --- configuration the pipeline needs --------------------------------------------------------


@dataclass(frozen=True)
class PipelineSettings:
    num_workers: int = 2
    backlog_max_items: int = 4096
    backlog_mode: str = "block"  # or "drop_oldest"
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    max_items_per_request: int = 4096
    handle_ttl_s: float = 600.0
    collected_retention_s: float = 60.0


@dataclass(eq=False)
class Handle:
    id: str
    entries: list[Entry]
    created_at: float
    submit_s: float = 0.0
    collect_wait_s: float = 0.0
    # Submit to last result, once every item has one.
    reward_s: float | None = None
    collected_at: float | None = None

    @property
    def num_pending(self) -> int:
        return sum(1 for entry in self.entries if not entry.future.done())

    def results(self) -> list[RewardResult]:
        """Results in input order (every entry must be done)."""
        return [entry.future.result() for entry in self.entries]


# --- the pipeline ----------------------------------------------------------------------------


class RewardPipeline:
    """submit / wait / collect over one lane per configured manager."""

    def __init__(
        self,
        managers: Mapping[str, RewardManager],
        settings: PipelineSettings,
        metrics: RewardMetrics,
        *,
        batching: Mapping[str, BatchingConfig] | None = None,
        timeouts_s: Mapping[str, float | None] | None = None,
    ) -> None:
        if not managers:
            raise ValueError("the pipeline needs at least one manager")
        self.settings = settings
        self.metrics = metrics
        self.managers = dict(managers)
        self._lanes = {
            name: Lane(
                manager,
                (batching or {}).get(name) or settings.batching,
                settings.num_workers,
                (timeouts_s or {}).get(name),
                metrics,
            )
            for name, manager in managers.items()
        }
        self._handles: dict[str, Handle] = {}
        self._num_backlog = 0
        self._room = asyncio.Condition()
        self._num_waiting_for_room = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        metrics.backlog_capacity.set(settings.backlog_max_items)
        metrics.set_backlog(0)

    def lane(self, manager: str) -> Lane:
        return self._lanes[manager]

    @property
    def num_backlog(self) -> int:
        return self._num_backlog

    async def start(self) -> None:
        for lane in self._lanes.values():
            lane.start()
        self._sweeper = asyncio.create_task(self._sweep_handles(), name="reward-handle-sweeper")

    # -- submit ------------------------------------------------------------------------

    def validate(self, items: Sequence[RewardItem], options: SubmitOptions) -> None:
        """Raise InvalidRequest naming the first bad field; nothing is queued."""
        if options.manager not in self.managers:
            raise InvalidRequest(
                f"options.manager: unknown manager {options.manager!r} (configured: "
                f"{', '.join(sorted(self.managers))})"
            )
        if not items:
            raise InvalidRequest("items: empty; send at least one item")
        limit = min(self.settings.max_items_per_request, self.settings.backlog_max_items)
        if len(items) > limit:
            raise InvalidRequest(
                f"items: {len(items)} items in one request; at most {limit} fit "
                "(max_items_per_request / backlog.max_items): split it"
            )
        manager = self.managers[options.manager]
        seen: set[str] = set()
        for index, item in enumerate(items):
            where = f"items[{index}]"
            if not item.item_id:
                raise InvalidRequest(f"{where}.item_id: empty; give every item a unique id")
            if item.item_id in seen:
                raise InvalidRequest(
                    f"{where}.item_id: duplicate id {item.item_id!r}; ids must be unique "
                    "within a request"
                )
            seen.add(item.item_id)
            check_item(item, manager, options, where)

    async def submit(
        self,
        items: Sequence[RewardItem],
        options: SubmitOptions,
        *,
        deadline_s: float | None = None,
        validated: bool = False,
    ) -> Handle:
        """Accept `items` (all or none) and return their handle. Waits for backlog room in
        `block` mode, at most until `deadline_s` (loop time); raises RequestError."""
        if self._closing:
            raise Closing("the reward-service is shutting down; retry on another replica")
        if not validated:
            self.validate(items, options)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self._make_room(len(items), deadline_s)
        now = loop.time()
        entries = [Entry(item, loop.create_future(), options, now) for item in items]
        for entry in entries:
            entry.future.add_done_callback(self._entry_done)
        self._num_backlog += len(entries)
        self.metrics.set_backlog(self._num_backlog)
        self.metrics.items_submitted.labels(tenant=options.tenant, manager=options.manager).inc(
            len(entries)
        )
        handle = Handle(uuid.uuid4().hex, entries, created_at=now, submit_s=now - started)
        self._handles[handle.id] = handle
        self._lanes[options.manager].put(list(entries))
        self.metrics.submit_duration.observe(now - started)
        return handle

    async def _make_room(self, num_items: int, deadline_s: float | None) -> None:
        capacity = self.settings.backlog_max_items
        if self._num_backlog + num_items <= capacity:
            return
        if self.settings.backlog_mode == "drop_oldest":
            self._evict(self._num_backlog + num_items - capacity)
            if self._num_backlog + num_items <= capacity:
                return
        loop = asyncio.get_running_loop()
        timeout = None if deadline_s is None else max(0.0, deadline_s - loop.time())
        self._num_waiting_for_room += 1
        try:
            async with asyncio.timeout(timeout), self._room:
                await self._room.wait_for(
                    lambda: self._closing or self._num_backlog + num_items <= capacity
                )
        except TimeoutError:
            raise Overloaded(
                f"the backlog is full ({self._num_backlog} of {capacity} items) and did not "
                f"make room for {num_items} items before the deadline; retry later",
                retry_after_s=1.0,
            ) from None
        finally:
            self._num_waiting_for_room -= 1
        if self._closing:
            raise Closing("the reward-service is shutting down; retry on another replica")

    def _evict(self, num_items: int) -> None:
        now = asyncio.get_running_loop().time()
        for _ in range(num_items):
            candidates = [
                (entry.accepted_at, name)
                for name, lane in self._lanes.items()
                if (entry := lane.oldest_queued()) is not None
            ]
            if not candidates:
                return
            _, name = min(candidates)
            entry = self._lanes[name].evict_oldest()
            if entry is None:
                return
            error = RateLimited(
                "evicted from a full backlog (backlog.mode=drop_oldest) before it was scored; "
                "resubmit it",
                retry_after_s=1.0,
            )
            settle(entry, error_result(entry, error, now), self.metrics)
            self.metrics.evicted.labels(manager=name).inc()

    def _entry_done(self, future: asyncio.Future[RewardResult]) -> None:
        self._num_backlog -= 1
        self.metrics.set_backlog(self._num_backlog)
        if self._num_waiting_for_room:
            asyncio.get_running_loop().create_task(self._notify_room())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    # -- results -----------------------------------------------------------------------

    def handle(self, handle_id: str) -> Handle:
        try:
            return self._handles[handle_id]
        except KeyError:
            raise UnknownHandle(
                f"handle {handle_id!r} is unknown: never issued by this replica, or expired "
                f"(uncollected handles are kept {self.settings.handle_ttl_s:.0f} s)"
            ) from None

    async def wait(self, handle: Handle, timeout_s: float | None) -> bool:
        """Wait until every item of `handle` has a result, at most `timeout_s`; True if so."""
        pending = [entry.future for entry in handle.entries if not entry.future.done()]
        started = time.monotonic()
        if pending and (timeout_s is None or timeout_s > 0):
            await asyncio.wait(pending, timeout=timeout_s)
        handle.collect_wait_s += time.monotonic() - started
        self.metrics.collect_wait.observe(time.monotonic() - started)
        done = handle.num_pending == 0
        if done and handle.reward_s is None:
            handle.reward_s = max(e.future.result().latency_s for e in handle.entries)
        return done

    async def collect(self, handle_id: str, wait_s: float) -> tuple[bool, list[RewardResult]]:
        """(done, results in input order); results are empty until done."""
        handle = self.handle(handle_id)
        done = await self.wait(handle, wait_s)
        self.metrics.collects.labels(done=str(done).lower()).inc()
        if not done:
            return False, []
        if handle.collected_at is None:
            handle.collected_at = time.monotonic()
            self.metrics.handle_finished(
                handle.submit_s, handle.reward_s or 0.0, handle.collect_wait_s
            )
        return True, handle.results()

    def expire(self, handle: Handle, message: str) -> None:
        """Give every unfinished item of `handle` a TIMEOUT result (the caller's deadline)."""
        now = asyncio.get_running_loop().time()
        for entry in handle.entries:
            if not entry.future.done():
                settle(entry, error_result(entry, ScoringTimeout(message), now), self.metrics)

    def forget(self, handle: Handle) -> None:
        self._handles.pop(handle.id, None)

    async def score(
        self, items: Sequence[RewardItem], options: SubmitOptions, deadline_s: float | None
    ) -> list[RewardResult]:
        """Submit, wait until done or `deadline_s` (unfinished items: TIMEOUT), return all."""
        handle = await self.submit(items, options, deadline_s=deadline_s)
        try:
            timeout = None
            if deadline_s is not None:
                timeout = max(0.0, deadline_s - asyncio.get_running_loop().time())
            if not await self.wait(handle, timeout):
                self.expire(handle, "the call's deadline passed before the item was scored")
                handle.reward_s = max(e.future.result().latency_s for e in handle.entries)
            self.metrics.handle_finished(
                handle.submit_s, handle.reward_s or 0.0, handle.collect_wait_s
            )
            return handle.results()
        finally:
            self.forget(handle)

    async def _sweep_handles(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep_handles(time.monotonic())

    def sweep_handles(self, now: float) -> None:
        """Forget handles collected long ago, or never collected within handle_ttl_s."""
        settings = self.settings
        for handle_id, handle in list(self._handles.items()):
            collected = handle.collected_at
            if collected is not None and now - collected > settings.collected_retention_s:
                del self._handles[handle_id]
            elif collected is None and now - handle.created_at > settings.handle_ttl_s:
                logger.warning(
                    "handle %s was never collected within %.0f s; dropping its %d results",
                    handle_id,
                    settings.handle_ttl_s,
                    len(handle.entries),
                )
                self.expire(handle, "the handle expired before its items were scored")
                del self._handles[handle_id]

    # -- shutdown ----------------------------------------------------------------------

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let queued items be scored for up to `grace_s`, fail the rest as
        INFRA_ERROR (the caller may resubmit elsewhere), close the managers."""
        self._closing = True
        async with self._room:
            self._room.notify_all()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await asyncio.gather(*(lane.close(grace_s) for lane in self._lanes.values()))
        now = asyncio.get_running_loop().time()
        error = InfraError("the reward-service shut down before the item was scored")
        for handle in self._handles.values():
            for entry in handle.entries:
                settle(entry, error_result(entry, error, now), self.metrics)
        for manager in _unique(self.managers.values()):
            try:
                await manager.close()
            except Exception:
                logger.exception("closing manager %s failed", manager.name)


def check_item(
    item: RewardItem, manager: RewardManager, options: SubmitOptions, where: str
) -> None:
    """Per-item checks shared by every front door; raises InvalidRequest naming `where`."""
    try:
        size = item.group_size
    except ValueError:
        raise InvalidRequest(
            f"{where}.extra[group_size]: {item.extra.get('group_size')!r} is not an integer"
        ) from None
    if size is not None and size < 1:
        raise InvalidRequest(f"{where}.extra[group_size]: must be >= 1, got {size}")
    if size is not None and not item.group_id:
        raise InvalidRequest(f"{where}.group_id: extra.group_size is set but group_id is empty")
    try:
        if options.token_level:
            token_level_scores(item, 0.0)
        manager.validate(item)
    except InvalidItem as exc:
        raise InvalidRequest(f"{where} ({item.item_id!r}): {exc.message}") from None


def _unique(managers: Iterable[RewardManager]) -> list[RewardManager]:
    seen: dict[int, RewardManager] = {}
    for manager in managers:
        seen.setdefault(id(manager), manager)
    return list(seen.values())
