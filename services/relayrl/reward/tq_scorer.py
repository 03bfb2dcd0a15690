"""The TransferQueue front door (docs/rewards.md#transferqueue-scorer): score trajectories as
they become `finished`, write the results back, and mark them `scored`.

Delivery is at-least-once and the effect exactly-once: every replica reads the partition's
event stream through one consumer group, acknowledges an event only after its score is
stored, and `score_trajectories` keeps the first score of a key. A replica killed mid-batch
leaves its events pending; they are re-read on restart (same reader name) or taken over by
another replica after `reclaim_idle_s`, and re-scoring an already scored trajectory is a
no-op. A Redis that stops answering mid-batch (a restart, a partition) is waited out in place,
while the events are still this reader's: a link that heals in seconds costs seconds, not a
reclaim. A failed score is stored with its status (INFRA_ERROR, TIMEOUT, ...), which marks the
trajectory `is_infra` so the trainer keeps it out of group baselines: never a reward of 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from relayrl.proto.common.v1 import common_pb2
from relayrl.reward.config import PIPELINE_TENANT, TQScorerConfig
from relayrl.reward.convert import reported_reward, result_to_proto
from relayrl.reward.items import InvalidItem, RewardItem, RewardResult
from relayrl.reward.pipeline import InvalidRequest, RequestError, RewardPipeline, SubmitOptions
from relayrl.tq import AsyncEventConsumer, AsyncTransferQueue, TQUnavailableError
from relayrl.tq.errors import TQError, UnknownKeyError
from relayrl.tq.model import Event, TrajectoryStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")

WANTS = {("trajectory", TrajectoryStatus.FINISHED.value)}
READ_BLOCK_S = 1.0
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


def retry_delay_s(failures: int) -> float:
    """The wait before the next try after `failures` failures in a row."""
    return RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1]


def default_reader_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def item_of(group: common_pb2.PromptGroup, trajectory: common_pb2.Trajectory) -> RewardItem:
    """The reward item of one trajectory: the response as the policy wrote it, the group's
    data_source and ground truth, the group as the normalisation group, and the environment's
    reward as the gateway wrote it on the trajectory at its close. InvalidItem when that reward
    is malformed."""
    prompt = "\n".join(message.content for message in group.messages)
    extra = {**group.labels, **trajectory.labels, "group_size": str(group.num_samples)}
    item_id = f"{trajectory.uid}_{trajectory.index}"
    return RewardItem(
        item_id=item_id,
        data_source=group.data_source,
        prompt=prompt,
        response=trajectory.response_text,
        ground_truth=group.ground_truth,
        response_token_ids=tuple(trajectory.response_token_ids),
        response_mask=bytes(trajectory.response_mask),
        group_id=group.uid,
        extra=extra,
        env_reward=reported_reward(item_id, trajectory),
    )


class TQScorer:
    """One reader per configured partition, scoring through the shared pipeline."""

    def __init__(
        self,
        tq: AsyncTransferQueue,
        pipeline: RewardPipeline,
        config: TQScorerConfig,
        default_manager: str,
    ) -> None:
        self._tq = tq
        self._pipeline = pipeline
        self._config = config
        self._default_manager = config.manager or default_manager
        self._reader = config.reader or default_reader_name()
        self._inflight = 0
        self._room = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._readers: list[asyncio.Task[None]] = []
        self._closing = False

    async def start(self) -> None:
        """Start one reader per partition. Redis need not be up yet (in a pod it may start
        after us): each reader retries until it can join its consumer group."""
        for partition in self._config.partitions:
            self._readers.append(
                asyncio.create_task(self._read_loop(partition), name=f"tq-{partition}")
            )

    async def _join(self, partition: str) -> AsyncEventConsumer:
        failures = 0
        while True:
            try:
                await self._tq.create_partition(partition)
                # a Redis without AOF is never read from (an error, retried: loud)
                await self._tq.check_durability()
                consumer = AsyncEventConsumer(
                    self._tq,
                    partition,
                    group=self._config.consumer_group,
                    reader=self._reader,
                    wants=WANTS,
                    reclaim_idle_s=self._config.reclaim_idle_s,
                    max_deliveries=self._config.max_deliveries,
                )
                await consumer.create_group()
            except TQError as exc:
                failures += 1
                await self._backoff(f"joining consumer group on {partition}", exc, failures)
                continue
            logger.info(
                "scoring finished trajectories of %s as reader %s of group %s",
                partition,
                self._reader,
                self._config.consumer_group,
            )
            return consumer

    @staticmethod
    async def _backoff(what: str, exc: Exception, failures: int) -> None:
        delay = retry_delay_s(failures)
        logger.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
        await asyncio.sleep(delay)

    async def _read_loop(self, partition: str) -> None:
        consumer = await self._join(partition)
        failures = 0
        while not self._closing:
            async with self._room:
                await self._room.wait_for(
                    lambda: self._inflight < self._config.max_inflight_items or self._closing
                )
            if self._closing:
                return
            count = min(self._config.read_count, self._config.max_inflight_items - self._inflight)
            try:
                events = await consumer.read(count, READ_BLOCK_S)
            except TQError as exc:
                failures += 1
                await self._backoff(f"reading {partition} events", exc, failures)
                continue
            failures = 0
            if events:
                self._inflight += len(events)
                task = asyncio.create_task(self._score_events(partition, consumer, events))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _score_events(
        self, partition: str, consumer: AsyncEventConsumer, events: list[Event]
    ) -> None:
        ours_until = time.monotonic() + self._config.reclaim_idle_s
        keys = [e.key for e in events]
        try:
            redelivered = sum(1 for event in events if event.deliveries > 1)
            if redelivered:
                self._pipeline.metrics.tq_redeliveries.labels(partition=partition).inc(redelivered)
            items, refused = await self._while_ours(
                ours_until,
                f"reading {partition} trajectories",
                lambda: self._items(partition, keys),
            )
            results = refused + await self._score(items)
            rewards = {r.item_id: result_to_proto(r) for r in results}
            if rewards:
                await self._while_ours(
                    ours_until,
                    f"storing {partition} scores",
                    lambda: self._tq.score_trajectories(partition, rewards),
                )
                for result in results:
                    self._pipeline.metrics.tq_scored.labels(
                        partition=partition, status=result.status.name
                    ).inc()
            await self._while_ours(
                ours_until, f"acknowledging {partition} events", lambda: consumer.ack(events)
            )
        except (TQError, RequestError) as exc:
            # Not acknowledged: the events stay pending and are delivered again.
            logger.warning(
                "scoring %d trajectories of %s failed (%s); they will be redelivered",
                len(events),
                partition,
                exc,
            )
        finally:
            self._inflight -= len(events)
            async with self._room:
                self._room.notify_all()

    async def _while_ours(
        self, ours_until: float, what: str, call: Callable[[], Awaitable[T]]
    ) -> T:
        """`call`, again after each lost connection to Redis until `ours_until` (read time +
        reclaim_idle_s: past it another replica may have taken the events); every step it
        retries is idempotent (reads, the first score of a key kept, acks)."""
        failures = 0
        while True:
            try:
                return await call()
            except TQUnavailableError as exc:
                failures += 1
                if self._closing or time.monotonic() + retry_delay_s(failures) > ours_until:
                    raise
                await self._backoff(what, exc, failures)

    async def _items(
        self, partition: str, keys: Sequence[str]
    ) -> tuple[list[RewardItem], list[RewardResult]]:
        """Items for the finished (not yet scored) trajectories among `keys`, and the results
        of those that can never be scored as written (stored as refused, not retried)."""
        trajectories = [
            t
            for t in await self._read_trajectories(partition, list(dict.fromkeys(keys)))
            if t.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
        ]
        uids = list(dict.fromkeys(t.uid for t in trajectories))
        groups = {
            g.group.uid: g.group
            for g in await self._tq.get_groups(partition, uids, with_trajectories=False)
        }
        items, refused = [], []
        for trajectory in trajectories:
            group = groups[trajectory.uid]
            try:
                items.append(item_of(group, trajectory))
            except InvalidItem as exc:
                item_id = f"{trajectory.uid}_{trajectory.index}"
                refused.append(RewardResult.failed(item_id, exc, self._manager_of(group)))
        return items, refused

    def _manager_of(self, item: RewardItem | common_pb2.PromptGroup) -> str:
        return self._config.managers_by_data_source.get(item.data_source, self._default_manager)

    async def _read_trajectories(
        self, partition: str, keys: list[str]
    ) -> list[common_pb2.Trajectory]:
        try:
            return await self._tq.get_trajectories(partition, keys)
        except UnknownKeyError:
            pass  # rare (a dropped group): read one by one and skip the missing ones
        found = []
        for key in keys:
            try:
                found += await self._tq.get_trajectories(partition, [key])
            except UnknownKeyError:
                logger.warning("%s/%s: event for a trajectory that is gone", partition, key)
        return found

    async def _score(self, items: list[RewardItem]) -> list[RewardResult]:
        by_manager: dict[str, list[RewardItem]] = defaultdict(list)
        for item in items:
            by_manager[self._manager_of(item)].append(item)
        results: list[RewardResult] = []
        for manager, batch in by_manager.items():
            results += await self._score_with(manager, batch)
        return results

    async def _score_with(self, manager: str, items: list[RewardItem]) -> list[RewardResult]:
        options = SubmitOptions(manager, PIPELINE_TENANT)
        accepted, refused = [], []
        for item in items:
            try:
                self._pipeline.validate([item], options)
                accepted.append(item)
            except InvalidRequest as exc:
                # This trajectory can never be scored as it is: store why, do not retry it.
                refused.append(RewardResult.failed(item.item_id, InvalidItem(str(exc)), manager))
        if not accepted:
            return refused
        handle = await self._pipeline.submit(accepted, options, validated=True)
        try:
            await self._pipeline.wait(handle, None)
            return refused + handle.results()
        finally:
            self._pipeline.forget(handle)

    async def close(self) -> None:
        self._closing = True
        async with self._room:
            self._room.notify_all()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        # In-flight batches finish (the pipeline closes after us); unacknowledged ones are
        # redelivered to whoever reads next.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await asyncio.gather(*self._tasks, return_exceptions=True)
