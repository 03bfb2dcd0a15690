"""Token buckets: the rate limits of tenants (requests and tokens per minute) and of the
`rate_limited` manager (an upstream API's rpm/tpm)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


class TokenBucket:
    """`capacity` units, refilled continuously at `capacity` per `period_s`.

    Spending is all-or-nothing: `try_spend(n)` either takes n units or takes none and says
    how long until n are available, so a caller can answer with a retry hint."""

    def __init__(
        self,
        capacity: float,
        period_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity <= 0 or period_s <= 0:
            raise ValueError(f"capacity and period_s must be > 0, got {capacity}, {period_s}")
        self.capacity = float(capacity)
        self._rate_per_s = capacity / period_s
        self._clock = clock
        self._level = float(capacity)
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._updated) * self._rate_per_s)
        self._updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` units are available (0: now; inf: never, it exceeds the
        capacity)."""
        if amount > self.capacity:
            return float("inf")
        self._refill()
        missing = amount - self._level
        return 0.0 if missing <= 0 else missing / self._rate_per_s

    def try_spend(self, amount: float) -> float:
        """Take `amount` units and return 0, or take nothing and return the seconds to wait."""
        wait = self.wait_s(amount)
        if wait == 0.0:
            self._level -= amount
        return wait

    def refund(self, amount: float) -> None:
        """Give back units taken for work that was then refused elsewhere."""
        self._refill()
        self._level = min(self.capacity, self._level + amount)


def spend_all(buckets: Sequence[tuple[TokenBucket, float]]) -> tuple[float, int]:
    """Spend from several buckets atomically: all or none. Returns (0, -1), or the longest
    wait and the index of the bucket that needs it."""
    waits = [bucket.wait_s(amount) for bucket, amount in buckets]
    longest = max(range(len(waits)), key=waits.__getitem__, default=-1)
    if longest >= 0 and waits[longest] > 0:
        return waits[longest], longest
    for bucket, amount in buckets:
        bucket.try_spend(amount)
    return 0.0, -1
