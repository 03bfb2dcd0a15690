"""Waiting out a dependency that went away (Redis restarting, a peer service being replaced).

A process that exits on the first lost connection turns every restart of a peer into a restart
of itself, and a restart loses what it held in memory. `Outage` is the alternative: on a
failure, log one line, back off, try again; after `timeout_s` of failures in a row, give up
with OutageTimeout (one line for the operator). The caller retries only what is safe to repeat.

    outage = Outage("the TransferQueue (redis://...)", timeout_s=600)
    while True:
        try:
            result = tq.consume(...)
            break
        except TQUnavailableError as exc:
            outage.failed(exc)
    outage.recovered()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


class OutageTimeout(RuntimeError):
    """A dependency stayed away longer than the caller waits."""


class Outage:
    def __init__(
        self,
        what: str,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        log: logging.Logger = logger,
    ) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self._clock, self._sleep, self._log = clock, sleep, log
        self._since: float | None = None
        self._failures = 0

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def failed(self, error: BaseException | str) -> None:
        """One more failure: logs the first, raises OutageTimeout past the deadline, else
        sleeps the next backoff."""
        now = self._clock()
        if self._since is None:
            self._since = now
            self._log.warning(
                "%s is unavailable (%s); retrying for up to %.0f s",
                self.what,
                error,
                self.timeout_s,
            )
        elif now - self._since > self.timeout_s:
            raise OutageTimeout(
                f"{self.what} was unavailable for {now - self._since:.0f} s "
                f"(the limit is {self.timeout_s:.0f} s): {error}"
            )
        self._sleep(BACKOFF_S[min(self._failures, len(BACKOFF_S) - 1)])
        self._failures += 1

    def recovered(self) -> None:
        if self._since is not None:
            self._log.info("%s is back after %.1f s", self.what, self._clock() - self._since)
        self._since, self._failures = None, 0

    def call(self, function: Callable[[], T], retry_on: tuple[type[BaseException], ...]) -> T:
        """`function()` until it does not raise one of `retry_on` (it must be safe to repeat)."""
        while True:
            try:
                result = function()
            except retry_on as exc:
                self.failed(exc)
                continue
            self.recovered()
            return result
