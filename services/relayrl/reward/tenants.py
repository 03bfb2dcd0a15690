"""Tenants: who may use which manager, and how much (requests and tokens per minute).

A tenant is the principal `auth:` established (a static token's name); without auth every
caller is `anonymous`. Quotas are token buckets, so a tenant over quota is told exactly when a
retry can succeed."""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.core.interceptors import Principal
from relayrl.reward.config import ANONYMOUS_TENANT, RewardConfig, TenantConfig
from relayrl.reward.limits import TokenBucket
from relayrl.reward.metrics import RewardMetrics
from relayrl.reward.pipeline import ManagerNotAllowed, RequestError


class QuotaExceeded(RequestError):
    """Over a tenant quota (RESOURCE_EXHAUSTED, with `retry_after_s`)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Buckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class Tenants:
    def __init__(self, config: RewardConfig, metrics: RewardMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._buckets: dict[str, _Buckets] = {}

    @staticmethod
    def name_of(principal: Principal | None) -> str:
        return principal.name if principal is not None else ANONYMOUS_TENANT

    def limits(self, tenant: str) -> TenantConfig:
        return self._config.tenant(tenant)

    def allowed_managers(self, tenant: str) -> list[str]:
        allowed = self.limits(tenant).managers
        return sorted(self._config.managers) if allowed is None else list(allowed)

    def check_manager(self, tenant: str, manager: str) -> None:
        if manager in self._config.managers and manager not in self.allowed_managers(tenant):
            raise ManagerNotAllowed(
                f"tenant {tenant!r} may not use manager {manager!r} (allowed: "
                f"{', '.join(self.allowed_managers(tenant)) or 'none'})"
            )

    def _buckets_of(self, tenant: str) -> _Buckets:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            limits = self.limits(tenant)
            buckets = _Buckets(
                TokenBucket(limits.requests_per_minute) if limits.requests_per_minute else None,
                TokenBucket(limits.tokens_per_minute) if limits.tokens_per_minute else None,
            )
            self._buckets[tenant] = buckets
        return buckets

    def charge(self, tenant: str, num_tokens: int, num_requests: int = 1) -> None:
        """Take one request and `num_tokens` from the tenant's quotas, or raise QuotaExceeded
        (taking nothing). A request larger than a whole minute's token quota can never pass;
        that is a request to split, said as such."""
        buckets = self._buckets_of(tenant)
        checks = [
            ("requests_per_minute", buckets.requests, num_requests),
            ("tokens_per_minute", buckets.tokens, num_tokens),
        ]
        waits: list[tuple[float, str, TokenBucket]] = []
        for quota, bucket, amount in checks:
            if bucket is None or amount <= 0:
                continue
            if amount > bucket.capacity:
                self._metrics.quota_rejections.labels(tenant=tenant, quota=quota).inc()
                raise QuotaExceeded(
                    f"this request needs {amount} of tenant {tenant!r}'s {quota} quota of "
                    f"{bucket.capacity:.0f}; split it into smaller requests",
                    retry_after_s=60.0,
                )
            waits.append((bucket.wait_s(amount), quota, bucket))
        worst = max(waits, default=None, key=lambda wait: wait[0])
        if worst is not None and worst[0] > 0:
            self._metrics.quota_rejections.labels(tenant=tenant, quota=worst[1]).inc()
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its {worst[1]} quota "
                f"({worst[2].capacity:.0f}); retry in {worst[0]:.2f} s",
                retry_after_s=worst[0],
            )
        for _, bucket, amount in checks:
            if bucket is not None and amount > 0:
                bucket.try_spend(amount)
