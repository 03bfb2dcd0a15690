"""weight-sync's Prometheus metrics. Labels are bounded: `boundary` is one of export,
transport, switch, load, restore, pause_window; `transport` a configured transport; `replica`
a registered replica id; `outcome` planned | committed | failed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relayrl.core.interceptors import DURATION_BUCKETS_S
from relayrl.core.metrics import metric_name

SERVICE = "weightsync"
BOUNDARIES = ("export", "transport", "switch", "load", "restore", "pause_window")


def _name(quantity: str, unit: str) -> str:
    return metric_name(SERVICE, quantity, unit)


class WeightSyncMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.boundary_duration = Histogram(
            _name("boundary_duration", "seconds"),
            "Duration of each boundary of a version switch (transport: first plan to last "
            "bucket; load and restore: per replica; pause_window: rollout paused).",
            ["boundary"],
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self.bytes = Counter(
            _name("transferred", "bytes"),
            "Bucket bytes received from senders, by transport.",
            ["transport"],
            registry=registry,
        )
        self.delivered = Counter(
            _name("delivered", "bytes"),
            "Bucket bytes delivered to engine workers (each worker counts), by data plane.",
            ["transport"],
            registry=registry,
        )
        self.delivery_rate = Gauge(
            _name("delivery_rate", "bytes_per_second"),
            "Bytes per second each engine worker received in the latest delivery, by data plane.",
            ["transport"],
            registry=registry,
        )
        self.failures = Counter(
            _name("failures", "total"),
            "Failures by boundary (a replica that needs a retry counts once per attempt).",
            ["boundary"],
            registry=registry,
        )
        self.transfers = Counter(
            _name("transfers", "total"),
            "Transfers by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.committed_version = Gauge(
            _name("committed", "version"),
            "The version committed on every live replica.",
            registry=registry,
        )
        self.replica_version = Gauge(
            _name("replica", "version"),
            "The version each replica holds.",
            ["replica"],
            registry=registry,
        )
        for boundary in BOUNDARIES:
            self.failures.labels(boundary)
