"""The TransferQueue's event streams: the transition log of each partition, consumer-group
reclaim and the dead letters (and their redrive)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relayrl.tq import codec
from relayrl.tq.base import QueueBase, _positive_int
from relayrl.tq.model import ConsumerGroupState, Event, PendingEntry
from relayrl.tq.steps import Script, Steps, command, operation


class QueueEvents(QueueBase):
    """Every transition is appended to its partition's stream `<prefix>events`; consumer
    groups read it (relayrl.tq.consumer), and entries delivered too often move to
    `<prefix>dead`."""

    @operation
    def event_stream_length(self, partition: str) -> Steps[int]:
        """Entries in the partition's event stream (above event_stream_max_len only while a
        consumer group has not acknowledged the oldest ones)."""
        codec.check_partition_name(partition)
        return int((yield command("xlen", self._events_key(partition))))

    @operation
    def redrive_dead_letters(
        self, partition: str, ids: Sequence[str] | None = None, count: int = 1000
    ) -> Steps[list[str]]:
        """Moves dead letters (all of them, up to `count`, or those with the given dead-letter
        ids) back into the event stream as new entries, so that their consumer group reads
        them again; returns the ids of the new entries. Atomic per call."""
        codec.check_partition_name(partition)
        _positive_int(count, "count")
        wanted = list(ids or [])
        raw = yield Script(
            partition,
            "redrive",
            [self._events_key(partition), self._dead_key(partition)],
            [count, len(wanted), *wanted],
        )
        return [entry.decode() if isinstance(entry, bytes) else entry for entry in raw]

    @operation
    def num_dead_letters(self, partition: str) -> Steps[int]:
        """Events given up on after too many deliveries (the dead-letter stream's length)."""
        codec.check_partition_name(partition)
        return int((yield command("xlen", self._dead_key(partition))))

    @operation
    def dead_letters(self, partition: str, count: int = 100) -> Steps[list[Event]]:
        """The oldest `count` dead letters, with their `dead_*` bookkeeping in `extra` (the
        consumer group, reader and deliveries that gave up, and the event's own id)."""
        codec.check_partition_name(partition)
        entries = yield command("xrange", self._dead_key(partition), "-", "+", count)
        return [event_from_entry(entry_id, fields) for entry_id, fields in entries]

    @operation
    def consumer_groups(
        self, partition: str, page: int = 10_000
    ) -> Steps[dict[str, ConsumerGroupState]]:
        """The consumer groups reading the partition's event stream, by name, with every entry
        each has been delivered and not acknowledged (read `page` at a time)."""
        codec.check_partition_name(partition)
        stream = self._events_key(partition)
        out: dict[str, ConsumerGroupState] = {}
        infos = []
        if (yield command("exists", stream)):
            infos = yield command("xinfo_groups", stream)
        for info in infos:
            name = info["name"].decode()
            pending = yield from self._pending(stream, name, page)
            out[name] = ConsumerGroupState(name, info["last-delivered-id"].decode(), pending)
        return out

    def _pending(self, stream: str, group: str, page: int) -> Steps[list[PendingEntry]]:
        out: list[PendingEntry] = []
        start = "-"
        while True:
            entries = yield command("xpending_range", stream, group, start, "+", page)
            out += [
                PendingEntry(p["message_id"].decode(), p["consumer"].decode(), p["times_delivered"])
                for p in entries
            ]
            if len(entries) < page:
                return out
            start = f"({out[-1].id}"

    @operation
    def follow_events(
        self, partition: str, after: str, *, block_ms: int | None = None, count: int | None = None
    ) -> Steps[list[Event]]:
        """Transitions after event id `after` ("$": only those appended from now on), waiting up
        to `block_ms` for the first when there is none yet (None: no wait); at most `count`."""
        codec.check_partition_name(partition)
        stream = self._events_key(partition)
        block = None if block_ms is None else self._block_ms(block_ms)
        reply = yield command("xread", {stream: after}, count=count, block=block)
        return [event_from_entry(i, f) for _, entries in reply or [] for i, f in entries]

    @operation
    def wait_for_pending(
        self, partition: str, after: str = "$", *, block_ms: int
    ) -> Steps[tuple[str, bool]]:
        """Waits up to `block_ms` for transitions after event id `after` ("$": from now on) and
        returns the id of the last one read (`after` when none came) and whether any of them
        made a group pending: what a claim loop waits on instead of polling."""
        codec.check_partition_name(partition)
        stream = self._events_key(partition)
        reply = yield command("xread", {stream: after}, block=self._block_ms(block_ms))
        last_id, pending = after, False
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if fields.get(b"kind") == b"group" and fields.get(b"to") == b"pending":
                    pending = True
        return last_id, pending

    @operation
    def reclaim_events(
        self,
        partition: str,
        *,
        group: str,
        reader: str,
        min_idle_ms: int,
        count: int,
        max_deliveries: int,
    ) -> Steps[tuple[list[Event], int]]:
        """Claims for `reader` the entries of consumer group `group` idle for `min_idle_ms`,
        moving those delivered `max_deliveries` times to the dead-letter stream. Returns the
        claimed events and the number dead-lettered. (EventConsumer.read calls this.)"""
        codec.check_partition_name(partition)
        raw = yield Script(
            partition,
            "reclaim",
            [self._events_key(partition), self._dead_key(partition)],
            [group, reader, min_idle_ms, count, max_deliveries],
        )
        events = []
        for i in range(1, len(raw), 3):
            fields = dict(zip(raw[i + 2][::2], raw[i + 2][1::2], strict=True))
            events.append(event_from_entry(raw[i], fields, deliveries=int(raw[i + 1])))
        return events, int(raw[0])

    @operation
    def read_events(
        self, partition: str, start: str = "-", count: int = 1000
    ) -> Steps[list[Event]]:
        """The partition's transition log from `start` (an event id, inclusive)."""
        codec.check_partition_name(partition)
        entries = yield command("xrange", self._events_key(partition), start, "+", count)
        return [event_from_entry(entry_id, fields) for entry_id, fields in entries]

    @operation
    def last_events(self, partition: str, count: int = 20) -> Steps[list[Event]]:
        """The partition's last `count` transitions, oldest first."""
        codec.check_partition_name(partition)
        entries = yield command("xrevrange", self._events_key(partition), count=count)
        return [event_from_entry(entry_id, fields) for entry_id, fields in reversed(entries)]


def event_from_entry(
    entry_id: bytes | str, fields: Mapping[bytes, bytes], deliveries: int = 1
) -> Event:
    decoded = {k.decode(): v.decode() for k, v in fields.items()}
    return Event(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        kind=decoded.pop("kind", ""),
        key=decoded.pop("key", ""),
        from_status=decoded.pop("from", ""),
        to_status=decoded.pop("to", ""),
        deliveries=deliveries,
        extra=decoded,
    )
