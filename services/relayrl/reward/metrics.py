"""The reward-service's Prometheus metrics (docs/rewards.md#overlap-ratio, plus per-backend
and per-tenant views). Labels are bounded: `tenant` is a configured principal (or `anonymous`, or
`pipeline` for the TransferQueue path), `manager` a configured manager name, `status` a
RewardStatus name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relayrl.core.interceptors import DURATION_BUCKETS_S
from relayrl.core.metrics import metric_name

SERVICE = "reward"
ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def _name(quantity: str, unit: str) -> str:
    return metric_name(SERVICE, quantity, unit)


class RewardMetrics:
    """Every metric the pipeline, the front doors and the TransferQueue scorer record."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.submissions = Counter(
            _name("submissions", "total"),
            "Submissions (one Score/Submit call, one streamed item, one TransferQueue batch).",
            ["tenant", "api"],
            registry=registry,
        )
        self.items_submitted = Counter(
            _name("items_submitted", "total"),
            "Items accepted into the backlog.",
            ["tenant", "manager"],
            registry=registry,
        )
        self.submit_duration = Histogram(
            _name("submit_duration", "seconds"),
            "Time a submission took to enter the backlog (includes back-pressure waits).",
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self.collects = Counter(
            _name("collects", "total"),
            "Collect calls, by whether the handle was complete.",
            ["done"],
            registry=registry,
        )
        self.collect_wait = Histogram(
            _name("collect_wait", "seconds"),
            "Time Collect/Score waited for results (the reward tail the caller sees).",
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self.backlog = Gauge(
            _name("backlog", "items"),
            "Items accepted and not yet finished (queued or being scored).",
            registry=registry,
        )
        self.backlog_max = Gauge(
            _name("backlog_max", "items"),
            "Largest backlog seen since start.",
            registry=registry,
        )
        self.backlog_capacity = Gauge(
            _name("backlog_capacity", "items"),
            "Configured backlog bound (pipeline.backlog.max_items).",
            registry=registry,
        )
        self.evicted = Counter(
            _name("items_evicted", "total"),
            "Queued items evicted by drop_oldest back-pressure (returned RATE_LIMITED).",
            ["manager"],
            registry=registry,
        )
        self.overlap_ratio = Gauge(
            _name("overlap", "ratio"),
            "1 - collect_wait / (submit + reward) over completed handles: the share of reward "
            "work hidden behind the caller's other work.",
            registry=registry,
        )
        self.backend_requests = Counter(
            _name("backend_requests", "total"),
            "Calls to a manager's backend (one micro-batch or chunk each).",
            ["manager"],
            registry=registry,
        )
        self.backend_request_items = Histogram(
            _name("backend_request", "items"),
            "Items carried by one backend call.",
            ["manager"],
            registry=registry,
            buckets=ITEM_BUCKETS,
        )
        self.backend_request_duration = Histogram(
            _name("backend_request_duration", "seconds"),
            "Duration of one backend call.",
            ["manager"],
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self.inflight_calls = Gauge(
            _name("backend_inflight", "calls"),
            "Backend calls running now.",
            ["manager"],
            registry=registry,
        )
        self.results = Counter(
            _name("results", "total"),
            "Item results by status.",
            ["tenant", "manager", "status"],
            registry=registry,
        )
        self.item_latency = Histogram(
            _name("item_latency", "seconds"),
            "Time from an item's acceptance to its result.",
            ["manager"],
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self.quota_rejections = Counter(
            _name("quota_rejections", "total"),
            "Requests refused by a tenant quota.",
            ["tenant", "quota"],
            registry=registry,
        )
        self.tq_scored = Counter(
            _name("tq_trajectories_scored", "total"),
            "Trajectories this service scored in the TransferQueue.",
            ["partition", "status"],
            registry=registry,
        )
        self.tq_redeliveries = Counter(
            _name("tq_redeliveries", "total"),
            "TransferQueue events delivered more than once (a reader died, or a write failed).",
            ["partition"],
            registry=registry,
        )
        self._submit_s = 0.0
        self._reward_s = 0.0
        self._collect_wait_s = 0.0
        self._max_backlog = 0

    def set_backlog(self, num_items: int) -> None:
        self.backlog.set(num_items)
        if num_items > self._max_backlog:
            self._max_backlog = num_items
            self.backlog_max.set(num_items)

    def handle_finished(self, submit_s: float, reward_s: float, collect_wait_s: float) -> None:
        """Fold one completed, collected handle into overlap_ratio
        (docs/rewards.md#overlap-ratio)."""
        self._submit_s += submit_s
        self._reward_s += reward_s
        self._collect_wait_s += collect_wait_s
        busy = self._submit_s + self._reward_s
        if busy > 0:
            self.overlap_ratio.set(max(0.0, 1.0 - self._collect_wait_s / busy))
