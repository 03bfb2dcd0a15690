"""Lanes: one per manager, turning queued items into backend calls (see pipeline.py for the
batching policy), and the entry/result bookkeeping they share with the pipeline."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

from relayrl.reward.items import (
    InvalidItem,
    RewardItem,
    RewardResult,
    ScoringError,
    ScoringTimeout,
    token_level_scores,
)
from relayrl.reward.managers.base import BatchingConfig, Outcome, RewardManager, call_batch
from relayrl.reward.metrics import RewardMetrics


@dataclass(frozen=True)
class SubmitOptions:
    manager: str
    tenant: str = "anonymous"
    token_level: bool = False
    # on_error=raise: the front door fails the call at the first failed item (the pipeline
    # itself always produces per-item statuses).
    raise_on_error: bool = False


# --- entries, units, handles -----------------------------------------------------------------


@dataclass(eq=False)
class Entry:
    """One accepted item: its result future settles exactly once (result, eviction, deadline)."""

    item: RewardItem
    future: asyncio.Future[RewardResult]
    options: SubmitOptions
    accepted_at: float


Unit = list[Entry]  # entries that must travel in the same backend call (a chunk, a group)


@dataclass
class _GroupBuffer:
    expected: int
    entries: list[Entry]
    first_at: float


# --- one lane per manager --------------------------------------------------------------------


class Lane:
    """Turns queued entries of one manager into backend calls."""

    def __init__(
        self,
        manager: RewardManager,
        batching: BatchingConfig,
        num_workers: int,
        timeout_s: float | None,
        metrics: RewardMetrics,
    ) -> None:
        self.manager = manager
        self.batching = batching
        self.num_workers = num_workers
        self.max_inflight = batching.max_inflight_calls or num_workers
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.queue: deque[Unit] = deque()
        self._num_queued = 0  # entries in `queue`, settled ones included
        self.num_inflight = 0
        self._groups: dict[str, _GroupBuffer] = {}
        self._group_timeout_s: float = getattr(manager, "group_timeout_s", 300.0)
        self._wake = asyncio.Event()
        self._calls: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def micro_batching(self) -> bool:
        return self.batching.micro_batch_size > 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"reward-lane-{self.manager.name}")

    # -- accepting -----------------------------------------------------------------------

    def put(self, entries: list[Entry]) -> None:
        if self.manager.group_aware:
            self._put_grouped(entries)
        elif self.micro_batching:
            for entry in entries:
                self._enqueue([entry])
        else:
            for chunk in split_chunks(entries, self.num_workers):
                self._enqueue(chunk)
        self._wake.set()

    def _put_grouped(self, entries: list[Entry]) -> None:
        by_group: dict[str, list[Entry]] = {}
        for entry in entries:
            item = entry.item
            if not item.group_id:
                self._enqueue([entry])
            elif item.group_size is None:
                by_group.setdefault(item.group_id, []).append(entry)
            else:
                self._gate(entry, item.group_id, item.group_size)
        for group in by_group.values():
            self._enqueue(group)

    def _gate(self, entry: Entry, group_id: str, expected: int) -> None:
        buffer = self._groups.get(group_id)
        if buffer is None:
            buffer = self._groups[group_id] = _GroupBuffer(expected, [], entry.accepted_at)
        buffer.entries.append(entry)
        if len(buffer.entries) >= buffer.expected:
            del self._groups[group_id]
            self._enqueue(buffer.entries)

    def _expire_groups(self, now: float) -> None:
        for group_id, buffer in list(self._groups.items()):
            live = [e for e in buffer.entries if not e.future.done()]
            if not live:
                del self._groups[group_id]
            elif now - buffer.first_at >= self._group_timeout_s:
                del self._groups[group_id]
                error = ScoringTimeout(
                    f"group {group_id!r} stayed incomplete ({len(buffer.entries)} of "
                    f"{buffer.expected} items) for {self._group_timeout_s:.0f} s"
                )
                for entry in live:
                    settle(entry, error_result(entry, error, now), self.metrics)

    # -- dispatching ---------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = loop.time()
            if self._groups:
                self._expire_groups(now)
            while self.queue and self.num_inflight < self.max_inflight:
                batch = self._next_batch(now)
                if batch is None:
                    break
                if batch:
                    self._dispatch(batch)
            if self._closing and not self.queue and not self.num_inflight:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._sleep_s(now)):
                    await self._wake.wait()

    def _enqueue(self, unit: Unit) -> None:
        self.queue.append(unit)
        self._num_queued += len(unit)

    def _pop_unit(self) -> Unit:
        """The next unit without its settled entries (a caller's deadline may have given them
        a result while they waited): dropped here, so nothing ever scans the whole queue."""
        unit = self.queue.popleft()
        self._num_queued -= len(unit)
        return [entry for entry in unit if not entry.future.done()]

    def _next_batch(self, now: float) -> list[Entry] | None:
        """The next call's entries (possibly empty, when all were settled), or None while a
        micro-batch is still filling."""
        if not self.micro_batching:
            return self._pop_unit()
        size = self.batching.micro_batch_size
        oldest = self.queue[0][0].accepted_at
        due = now - oldest >= self.batching.micro_batch_timeout_ms / 1000.0
        if self._num_queued < size and not due and not self._closing:
            return None
        batch = self._pop_unit()
        while self.queue and len(batch) + len(self.queue[0]) <= size:
            batch.extend(self._pop_unit())
        return batch

    def _sleep_s(self, now: float) -> float | None:
        deadlines = []
        if self.queue and self.micro_batching and self.num_inflight < self.max_inflight:
            oldest = self.queue[0][0].accepted_at
            deadlines.append(oldest + self.batching.micro_batch_timeout_ms / 1000.0)
        if self._groups:
            first = min(buffer.first_at for buffer in self._groups.values())
            deadlines.append(first + self._group_timeout_s)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - now)

    def _dispatch(self, batch: list[Entry]) -> None:
        self.num_inflight += 1
        self.metrics.inflight_calls.labels(manager=self.manager.name).inc()
        task = asyncio.create_task(self._call(batch))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[Entry]) -> None:
        name = self.manager.name
        loop = asyncio.get_running_loop()
        try:
            entries = [entry for entry in batch if not entry.future.done()]
            if not entries:
                return
            started = loop.time()
            outcomes = await self._outcomes([entry.item for entry in entries])
            finished = loop.time()
            self.metrics.backend_requests.labels(manager=name).inc()
            self.metrics.backend_request_items.labels(manager=name).observe(len(entries))
            self.metrics.backend_request_duration.labels(manager=name).observe(finished - started)
            for entry, outcome in zip(entries, outcomes, strict=True):
                if not entry.future.done():
                    settle(entry, result_of(entry, outcome, name, finished), self.metrics)
        finally:
            self.num_inflight -= 1
            self.metrics.inflight_calls.labels(manager=name).dec()
            self._wake.set()

    async def _outcomes(self, items: list[RewardItem]) -> list[Outcome]:
        if self.timeout_s is None:
            return await call_batch(self.manager, items)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call_batch(self.manager, items)
        except TimeoutError:
            error = ScoringTimeout(
                f"{self.manager.name}: the backend call exceeded timeout_s={self.timeout_s}"
            )
            return [error] * len(items)

    # -- eviction and shutdown -----------------------------------------------------------

    def oldest_queued(self) -> Entry | None:
        for unit in self.queue:
            for entry in unit:
                if not entry.future.done():
                    return entry
        return None

    def evict_oldest(self) -> Entry | None:
        """Remove and return the oldest queued entry (not one being scored)."""
        while self.queue:
            unit = self.queue[0]
            entry = unit.pop(0)
            self._num_queued -= 1
            if not unit:
                self.queue.popleft()
            if not entry.future.done():
                return entry
        return None

    async def close(self, grace_s: float) -> None:
        """Send what is queued, wait up to `grace_s` for running calls, then cancel them."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(self._task)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)


def split_chunks(entries: list[Entry], num_workers: int) -> list[Unit]:
    """The reference pipeline's split (docs/rewards.md#micro-batching): min(num_workers, n)
    contiguous chunks of near-equal size."""
    num_chunks = max(1, min(num_workers, len(entries)))
    size, extra = divmod(len(entries), num_chunks)
    chunks, start = [], 0
    for index in range(num_chunks):
        end = start + size + (1 if index < extra else 0)
        chunks.append(entries[start:end])
        start = end
    return chunks


# --- results ---------------------------------------------------------------------------------


def result_of(entry: Entry, outcome: Outcome, manager: str, now: float) -> RewardResult:
    latency_s = now - entry.accepted_at
    if isinstance(outcome, ScoringError):
        return error_result(entry, outcome, now, manager)
    token_scores: tuple[float, ...] = ()
    if entry.options.token_level:
        try:
            token_scores = token_level_scores(entry.item, outcome.score)
        except InvalidItem as exc:  # checked at submit; kept for managers that rewrite items
            return error_result(entry, exc, now, manager)
    return RewardResult(
        item_id=entry.item.item_id,
        status=outcome.status,
        score=outcome.score,
        components=dict(outcome.components),
        message=outcome.message,
        manager=manager,
        latency_s=latency_s,
        token_level_scores=token_scores,
    )


def error_result(
    entry: Entry, error: ScoringError, now: float, manager: str | None = None
) -> RewardResult:
    return RewardResult.failed(
        entry.item.item_id,
        error,
        manager=manager or entry.options.manager,
        latency_s=now - entry.accepted_at,
    )


def settle(entry: Entry, result: RewardResult, metrics: RewardMetrics) -> None:
    """Give an entry its one result and count it."""
    if entry.future.done():
        return
    entry.future.set_result(result)
    metrics.results.labels(
        tenant=entry.options.tenant, manager=entry.options.manager, status=result.status.name
    ).inc()
    metrics.item_latency.labels(manager=entry.options.manager).observe(result.latency_s)
