"""The TransferQueue's event streams: the transition log of each partition, consumer-group
reclaim and the dead letters (and their redrive)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relayrl.tq import codec
from relayrl.tq.base import QueueBase, _positive_int, unavailable_as_tq_error
from relayrl.tq.model import Event


class QueueEvents(QueueBase):
    """Every transition is appended to its partition's stream `<prefix>events`; consumer
    groups read it (relayrl.tq.consumer), and entries delivered too often move to
    `<prefix>dead`."""

    def event_stream_length(self, partition: str) -> int:
        """Entries in the partition's event stream (above event_stream_max_len only while a
        consumer group has not acknowledged the oldest ones)."""
        codec.check_partition_name(partition)
        with unavailable_as_tq_error():
            return int(self._redis.xlen(f"{self.key_prefix(partition)}events"))

    def redrive_dead_letters(
        self, partition: str, ids: Sequence[str] | None = None, count: int = 1000
    ) -> list[str]:
        """Moves dead letters (all of them, up to `count`, or those with the given dead-letter
        ids) back into the event stream as new entries, so that their consumer group reads
        them again; returns the ids of the new entries. Atomic per call."""
        codec.check_partition_name(partition)
        _positive_int(count, "count")
        prefix = self.key_prefix(partition)
        wanted = list(ids or [])
        raw = self._run(
            partition,
            "redrive",
            [f"{prefix}events", f"{prefix}dead"],
            [count, len(wanted), *wanted],
        )
        return [entry.decode() if isinstance(entry, bytes) else entry for entry in raw]

    def num_dead_letters(self, partition: str) -> int:
        """Events given up on after too many deliveries (the dead-letter stream's length)."""
        codec.check_partition_name(partition)
        with unavailable_as_tq_error():
            return int(self._redis.xlen(f"{self.key_prefix(partition)}dead"))

    def reclaim_events(
        self,
        partition: str,
        *,
        group: str,
        reader: str,
        min_idle_ms: int,
        count: int,
        max_deliveries: int,
    ) -> tuple[list[Event], int]:
        """Claims for `reader` the entries of consumer group `group` idle for `min_idle_ms`,
        moving those delivered `max_deliveries` times to the dead-letter stream. Returns the
        claimed events and the number dead-lettered. (EventConsumer.read calls this.)"""
        prefix = self.key_prefix(codec.check_partition_name(partition))
        raw = self._run(
            partition,
            "reclaim",
            [f"{prefix}events", f"{prefix}dead"],
            [group, reader, min_idle_ms, count, max_deliveries],
        )
        events = []
        for i in range(1, len(raw), 3):
            fields = dict(zip(raw[i + 2][::2], raw[i + 2][1::2], strict=True))
            events.append(event_from_entry(raw[i], fields, deliveries=int(raw[i + 1])))
        return events, int(raw[0])

    def read_events(self, partition: str, start: str = "-", count: int = 1000) -> list[Event]:
        """The partition's transition log from `start` (an event id, inclusive)."""
        codec.check_partition_name(partition)
        with unavailable_as_tq_error():
            entries = self._redis.xrange(f"{self.key_prefix(partition)}events", start, "+", count)
        return [event_from_entry(entry_id, fields) for entry_id, fields in entries]

    def last_events(self, partition: str, count: int = 20) -> list[Event]:
        """The partition's last `count` transitions, oldest first."""
        codec.check_partition_name(partition)
        with unavailable_as_tq_error():
            entries = self._redis.xrevrange(f"{self.key_prefix(partition)}events", count=count)
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
