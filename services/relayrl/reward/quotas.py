"""Where the tenants' quota buckets live.

`memory`: in this replica. Right for one replica; with N replicas behind a Service (the
chart's HPA runs up to four) each has its own buckets, so a tenant gets N times its quota.
`redis`: in the Redis of the `tq:` section, shared by every replica, so a tenant's quota is the
same with one pod or four. One Lua script takes from all of a call's buckets at once (the
requests and the tokens quota: all or nothing) using Redis's own clock, so replicas whose
clocks differ still agree. A bucket's key expires once it would be full again, so idle tenants
cost nothing.

If Redis cannot be reached the call is refused as UNAVAILABLE (retry later): a quota that
cannot be checked is not waived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from relayrl.reward.limits import TokenBucket, spend_all
from relayrl.reward.pipeline import RequestError
from relayrl.tq.config import TQConfig

PERIOD_S = 60.0
"""Quotas are per minute: a bucket holds one minute's quota and refills in a minute."""


class QuotaStoreUnavailable(RequestError):
    """The shared quota store did not answer (UNAVAILABLE): retry later."""


@dataclass(frozen=True)
class Demand:
    """What a call takes from one of its tenant's buckets."""

    quota: str  # requests_per_minute or tokens_per_minute
    capacity: float  # the bucket's size: one minute of quota
    amount: float


class QuotaStore(Protocol):
    async def take(self, tenant: str, demands: Sequence[Demand]) -> tuple[float, str]:
        """Take every demand from `tenant`'s buckets, or none: (0, "") when taken, else the
        seconds until they could be and the quota that is short."""
        ...

    async def close(self) -> None: ...


class MemoryQuotas:
    """Buckets in this process (one replica's view)."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, tenant: str, demand: Demand) -> TokenBucket:
        key = (tenant, demand.quota)
        bucket = self._buckets.get(key)
        if bucket is None or bucket.capacity != demand.capacity:
            bucket = self._buckets[key] = TokenBucket(demand.capacity, PERIOD_S)
        return bucket

    async def take(self, tenant: str, demands: Sequence[Demand]) -> tuple[float, str]:
        wait, short = spend_all([(self._bucket(tenant, d), d.amount) for d in demands])
        return (wait, demands[short].quota) if wait > 0 else (0.0, "")

    async def close(self) -> None:
        return None


# KEYS: one hash per bucket. ARGV: per bucket, capacity, rate per second, amount.
# Returns {1} when taken, else {0, wait seconds as a string, index of the short bucket}.
_TAKE_SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6
local levels = {}
local worst, worst_index = 0, 0
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[3 * i - 2])
  local rate = tonumber(ARGV[3 * i - 1])
  local amount = tonumber(ARGV[3 * i])
  local stored = redis.call('HMGET', KEYS[i], 'level', 'updated')
  local level = tonumber(stored[1]) or capacity
  local updated = tonumber(stored[2]) or now
  level = math.min(capacity, level + math.max(0, now - updated) * rate)
  levels[i] = level
  if amount > level then
    local wait = (amount - level) / rate
    if wait > worst then worst, worst_index = wait, i end
  end
end
if worst > 0 then
  return {0, tostring(worst), worst_index}
end
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[3 * i - 2])
  local rate = tonumber(ARGV[3 * i - 1])
  local level = levels[i] - tonumber(ARGV[3 * i])
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'updated', tostring(now))
  redis.call('EXPIRE', KEYS[i], math.ceil((capacity - level) / rate) + 1)
end
return {1}
"""


class RedisQuotas:
    """Buckets in Redis, shared by every replica that uses the same Redis and namespace."""

    def __init__(self, config: TQConfig) -> None:
        import redis.asyncio as aioredis

        from relayrl.tq.queue import redis_options

        self._redis = aioredis.Redis.from_url(config.url, **redis_options(config))
        self._prefix = f"{{{config.namespace}}}:reward:quota:"
        self._script = self._redis.register_script(_TAKE_SCRIPT)

    def key(self, tenant: str, quota: str) -> str:
        return f"{self._prefix}{tenant}:{quota}"

    async def take(self, tenant: str, demands: Sequence[Demand]) -> tuple[float, str]:
        if not demands:
            return 0.0, ""
        keys = [self.key(tenant, d.quota) for d in demands]
        args: list[float] = []
        for d in demands:
            args += [d.capacity, d.capacity / PERIOD_S, d.amount]
        try:
            reply = await self._script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise QuotaStoreUnavailable(
                f"the shared quota store (Redis) did not answer ({type(exc).__name__}: {exc}); "
                "retry later"
            ) from exc
        if int(reply[0]) == 1:
            return 0.0, ""
        return float(reply[1]), demands[int(reply[2]) - 1].quota

    async def close(self) -> None:
        await self._redis.aclose()
