"""Prometheus view of the TransferQueue, read from Redis on every scrape.

A service registers one TQCollector in its own CollectorRegistry; operators then see, per
partition, groups and trajectories by status, the launched counter the gateway's throttle uses,
how stale the groups in flight are (staleness = step - prompt_step + 1), and how many events
sit in the dead-letter stream (poison entries no consumer could process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from relayrl.core.metrics import metric_name
from relayrl.tq.errors import TQError
from relayrl.tq.queue import TransferQueue

log = logging.getLogger(__name__)


class TQCollector(Collector):
    def __init__(
        self,
        tq: TransferQueue,
        service: str,
        partitions: Sequence[str],
        current_step: Callable[[], int | None] = lambda: None,
        max_staleness_label: int = 16,
    ) -> None:
        """`current_step` gives the trainer step to measure staleness against (None: skip the
        staleness gauge). Staleness above `max_staleness_label` is reported as one
        "<max>+" label, so the label set stays bounded."""
        self._tq = tq
        self._partitions = list(partitions)
        self._current_step = current_step
        self._max_label = max_staleness_label
        self._names = {
            "up": metric_name(service, "tq_up", "bool"),
            "groups": metric_name(service, "tq", "groups"),
            "trajectories": metric_name(service, "tq", "trajectories"),
            "launched": metric_name(service, "tq_launched", "groups"),
            "stale": metric_name(service, "tq_stale", "groups"),
            "dead": metric_name(service, "tq_dead_letter", "events"),
            "events": metric_name(service, "tq_event_stream", "entries"),
        }

    def describe(self) -> list:
        return []  # collected live; nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(self._names["up"], "1 when the TransferQueue answered this scrape")
        try:
            families = self._read()
        except TQError as exc:
            log.warning("TransferQueue metrics unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self) -> list[GaugeMetricFamily]:
        names = self._names
        groups = GaugeMetricFamily(
            names["groups"], "Prompt groups by status", labels=["partition", "status"]
        )
        trajectories = GaugeMetricFamily(
            names["trajectories"], "Trajectories by status", labels=["partition", "status"]
        )
        launched = GaugeMetricFamily(
            names["launched"],
            "Groups claimed and not returned to pending (the throttle's count)",
            labels=["partition"],
        )
        stale = GaugeMetricFamily(
            names["stale"],
            "Groups in flight or ready by staleness (step - prompt_step + 1)",
            labels=["partition", "status", "staleness"],
        )
        dead = GaugeMetricFamily(
            names["dead"],
            "Events in the partition's dead-letter stream (given up on after max deliveries)",
            labels=["partition"],
        )
        events = GaugeMetricFamily(
            names["events"],
            "Entries in the partition's event stream (beyond tq.event_stream_max_len only while "
            "a consumer group has not acknowledged the oldest: the queue never trims those)",
            labels=["partition"],
        )
        step = self._current_step()
        for partition in self._partitions:
            counts = self._tq.counts(partition)
            for status, n in counts.groups.items():
                groups.add_metric([partition, status.value], n)
            for status, n in counts.trajectories.items():
                trajectories.add_metric([partition, status.value], n)
            launched.add_metric([partition], counts.num_launched)
            dead.add_metric([partition], self._tq.num_dead_letters(partition))
            events.add_metric([partition], self._tq.event_stream_length(partition))
            if step is not None:
                for status, histogram in self._tq.staleness(partition, step).items():
                    for label, n in self._bucket(histogram).items():
                        stale.add_metric([partition, status.value, label], n)
        return [groups, trajectories, launched, stale, dead, events]

    def _bucket(self, histogram: dict[int, int]) -> dict[str, int]:
        buckets: dict[str, int] = {}
        for staleness, n in histogram.items():
            label = str(staleness) if staleness <= self._max_label else f"{self._max_label}+"
            buckets[label] = buckets.get(label, 0) + n
        return buckets
