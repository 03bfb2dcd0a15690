"""Reading a partition's event stream as a consumer group, with acks, reclaim and dead letters.

Each role that reacts to transitions (the reward-service scoring finished trajectories, the
trainer waiting for scored groups) reads through its own consumer group, so every event is
delivered to one reader of that role and stays pending until acknowledged. A reader that dies
keeps its entries pending; once they have been idle for `reclaim_idle_s`, the next `read` of any
reader of the group claims them. An entry delivered `max_deliveries` times without an ack is a
poison entry: it is moved to the partition's dead-letter stream and acknowledged.

Processing must be idempotent in effect (the TransferQueue's transitions are: scoring an already
scored trajectory is a no-op), because a reader that dies after acting and before acking has its
entries delivered again.

`EventConsumer` reads through a TransferQueue, `AsyncEventConsumer` through an
AsyncTransferQueue; their operations are written once (relayrl.tq.steps).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import redis

from relayrl.tq import codec
from relayrl.tq.base import TQUnavailableError
from relayrl.tq.errors import InvalidInputError
from relayrl.tq.events import event_from_entry
from relayrl.tq.model import Event
from relayrl.tq.queue import QueueOperations, TransferQueue
from relayrl.tq.runners import AsyncRunner, SyncRunner
from relayrl.tq.steps import Steps, command, operation

logger = logging.getLogger(__name__)


class ConsumerOperations:
    """One reader of one consumer group on one partition's event stream: its operations, run
    on its queue's connection by EventConsumer or AsyncEventConsumer."""

    # The runner the queue must have (the consumer's operations run on the queue's).
    _runner_type: ClassVar[type]

    def __init__(
        self,
        tq: QueueOperations,
        partition: str,
        *,
        group: str,
        reader: str,
        wants: Iterable[tuple[str, str]] | None = None,
        reclaim_idle_s: float = 30.0,
        max_deliveries: int = 5,
        start_id: str = "0",
    ) -> None:
        """`wants`: (kind, to_status) pairs this role acts on, e.g. {("trajectory", "finished")};
        other events are acknowledged as soon as they are read. None: every event.
        `start_id`: where a new consumer group starts ("0": the whole log, "$": from now)."""
        if not isinstance(tq._runner, self._runner_type):
            raise TypeError(f"{type(self).__name__} reads through a {self._runner_type.__name__}")
        codec.check_partition_name(partition)
        for name, value in (("group", group), ("reader", reader)):
            if not isinstance(value, str) or not value:
                raise InvalidInputError(f"consumer {name} must be a non-empty name")
        if max_deliveries < 1:
            raise InvalidInputError(f"max_deliveries must be >= 1, got {max_deliveries}")
        if not reclaim_idle_s > 0:
            raise InvalidInputError(f"reclaim_idle_s must be > 0, got {reclaim_idle_s}")
        self._tq = tq
        self._runner = tq._runner
        self.partition, self.group, self.reader = partition, group, reader
        self._wants = None if wants is None else frozenset(wants)
        self._reclaim_idle_ms = max(1, round(reclaim_idle_s * 1000))
        self._max_deliveries = max_deliveries
        self._start_id = start_id
        self.stream = tq._events_key(partition)

    @operation
    def create_group(self) -> Steps[None]:
        """Creates the consumer group at `start_id`, unless it exists."""
        try:
            yield command(
                "xgroup_create", self.stream, self.group, id=self._start_id, mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @operation
    def read(self, count: int = 100, block_s: float = 1.0) -> Steps[list[Event]]:
        """Up to `count` events for this reader: first entries reclaimed from dead readers, then
        new ones (waiting up to `block_s` when there is nothing at all)."""
        if count < 1:
            raise InvalidInputError(f"count must be >= 1, got {count}")
        block_ms = self._tq._block_ms(max(1, round(block_s * 1000)))  # checked before any I/O
        events = yield from self._reclaim(count)
        if len(events) < count:
            reply = yield command(
                "xreadgroup",
                self.group,
                self.reader,
                {self.stream: ">"},
                count=count - len(events),
                block=None if events else block_ms,
            )
            for _, entries in reply or []:
                wanted = yield from self._wanted(entries)
                events += [event_from_entry(i, f) for i, f in wanted]
        return events

    def _wanted(
        self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]
    ) -> Steps[list[tuple[bytes, dict[bytes, bytes]]]]:
        """The entries this role acts on; the others are acknowledged at once."""
        wanted, unwanted = [], []
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending: the queue never trims such entries
                logger.error(
                    "event %s of %s was deleted from the stream while pending in group %s (by "
                    "hand?); what it announced is not processed through this event",
                    entry_id, self.stream, self.group,
                )  # fmt: skip
                unwanted.append(entry_id)
            elif self._wants is None or self._wants_kind_to(fields):
                wanted.append((entry_id, fields))
            else:
                unwanted.append(entry_id)
        yield from self._ack_unwanted(unwanted)
        return wanted

    def _wants_kind_to(self, fields: dict[bytes, bytes]) -> bool:
        kind, to = fields.get(b"kind", b"").decode(), fields.get(b"to", b"").decode()
        return (kind, to) in self._wants

    def _reclaim(self, count: int) -> Steps[list[Event]]:
        events, _ = yield from self._tq.reclaim_events.steps(
            self.partition,
            group=self.group,
            reader=self.reader,
            min_idle_ms=self._reclaim_idle_ms,
            count=count,
            max_deliveries=self._max_deliveries,
        )
        unwanted = [
            e.id for e in events if self._wants and (e.kind, e.to_status) not in self._wants
        ]
        yield from self._ack_unwanted(unwanted)
        return [e for e in events if e.id not in unwanted]

    def _ack_unwanted(self, ids: list[bytes] | list[str]) -> Steps[None]:
        """Acknowledges entries this role does not act on, read together with ones it does. If
        Redis goes away first, they stay pending (a later reclaim acknowledges them) and the
        read still returns its wanted events: raising would leave those delivered to this
        reader and unseen by it, pending until a reclaim, reclaim_idle_s later."""
        if not ids:
            return
        try:
            yield command("xack", self.stream, self.group, *ids)
        except TQUnavailableError as exc:
            logger.warning(
                "%d unwanted events of %s stay pending in group %s until reclaimed (%s)",
                len(ids), self.stream, self.group, exc,
            )  # fmt: skip

    @operation
    def ack(self, events: Iterable[Event | str]) -> Steps[int]:
        ids = [e.id if isinstance(e, Event) else e for e in events]
        if not ids:
            return 0
        return int((yield command("xack", self.stream, self.group, *ids)))

    @operation
    def pending_count(self) -> Steps[int]:
        """Entries delivered to this group and not yet acknowledged (any reader)."""
        return int((yield command("xpending", self.stream, self.group))["pending"])

    @operation
    def dead_letters(self, count: int = 100) -> Steps[list[Event]]:
        return (yield from self._tq.dead_letters.steps(self.partition, count))


class EventConsumer(ConsumerOperations):
    """A reader through a TransferQueue: it joins its consumer group when built (the options:
    ConsumerOperations), and every operation returns its result."""

    _runner_type = SyncRunner
    _runner: SyncRunner

    def __init__(self, tq: TransferQueue, partition: str, **options: Any) -> None:
        super().__init__(tq, partition, **options)
        self.create_group()


class AsyncEventConsumer(ConsumerOperations):
    """A reader through an AsyncTransferQueue: every operation is a coroutine, and
    `await create_group()` joins the consumer group before the first read (building one does no
    I/O)."""

    _runner_type = AsyncRunner
    _runner: AsyncRunner
