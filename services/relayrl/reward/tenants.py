"""Tenants: who may use which manager, and how much (requests and tokens per minute).

A tenant is the principal `auth:` established (a static token's name); without auth every
caller is `anonymous`. Quotas are token buckets, so a tenant over quota is told exactly when a
retry can succeed; they live in this replica or, shared by all replicas, in Redis
(relayrl.reward.quotas)."""

from __future__ import annotations

from relayrl.core.interceptors import Principal
from relayrl.reward.config import ANONYMOUS_TENANT, RewardConfig, TenantConfig
from relayrl.reward.metrics import RewardMetrics
from relayrl.reward.pipeline import ManagerNotAllowed, RequestError
from relayrl.reward.quotas import Demand, MemoryQuotas, QuotaStore


class QuotaExceeded(RequestError):
    """Over a tenant quota (RESOURCE_EXHAUSTED, with `retry_after_s`)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Tenants:
    def __init__(
        self, config: RewardConfig, metrics: RewardMetrics, store: QuotaStore | None = None
    ) -> None:
        """`store`: where the quota buckets live (default: this replica's memory)."""
        self._config = config
        self._metrics = metrics
        self._store = store or MemoryQuotas()

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

    async def charge(self, tenant: str, num_tokens: int, num_requests: int = 1) -> None:
        """Take one request and `num_tokens` from the tenant's quotas, or raise QuotaExceeded
        (taking nothing). A request larger than a whole minute's token quota can never pass;
        that is a request to split, said as such. QuotaStoreUnavailable when the shared
        store does not answer."""
        limits = self.limits(tenant)
        demands = [
            Demand(quota, capacity, amount)
            for quota, capacity, amount in (
                ("requests_per_minute", limits.requests_per_minute, num_requests),
                ("tokens_per_minute", limits.tokens_per_minute, num_tokens),
            )
            if capacity and amount > 0
        ]
        for demand in demands:
            if demand.amount > demand.capacity:
                self._metrics.quota_rejections.labels(tenant=tenant, quota=demand.quota).inc()
                raise QuotaExceeded(
                    f"this request needs {demand.amount:.0f} of tenant {tenant!r}'s "
                    f"{demand.quota} quota of {demand.capacity:.0f}; split it into smaller "
                    "requests",
                    retry_after_s=60.0,
                )
        wait_s, quota = await self._store.take(tenant, demands)
        if wait_s > 0:
            self._metrics.quota_rejections.labels(tenant=tenant, quota=quota).inc()
            capacity = next(d.capacity for d in demands if d.quota == quota)
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its {quota} quota ({capacity:.0f}); retry in "
                f"{wait_s:.2f} s",
                retry_after_s=wait_s,
            )

    async def close(self) -> None:
        await self._store.close()
