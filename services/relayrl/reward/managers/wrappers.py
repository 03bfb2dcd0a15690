"""Managers that wrap another configured manager: `rate_limited` (an upstream's rpm/tpm budget
and a per-call deadline) and `dapo` (DAPO's soft overlong penalty on top of any scorer)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from relayrl.reward.items import InvalidItem, RateLimited, RewardItem, ScoringError, ScoringTimeout
from relayrl.reward.limits import TokenBucket
from relayrl.reward.managers.base import (
    ManagerConfigBase,
    ManagerContext,
    Outcome,
    RewardManager,
    call_batch,
)


class WrapperManager(RewardManager):
    """Delegates validation, batching ability and group awareness to the wrapped manager."""

    def __init__(self, name: str, inner: RewardManager) -> None:
        super().__init__(name)
        self.inner = inner
        self.supports_batch = inner.supports_batch  # type: ignore[misc]
        self.group_aware = inner.group_aware  # type: ignore[misc]

    @property
    def data_sources(self) -> tuple[str, ...]:
        return self.inner.data_sources

    def validate(self, item: RewardItem) -> None:
        self.inner.validate(item)


# --- rate_limited ----------------------------------------------------------------------------


class RateLimitedConfig(ManagerConfigBase):
    """Calls `inner` within an upstream's requests- and tokens-per-minute budget (a hosted
    judge API, say). A call that cannot get its budget within `max_wait_s` comes back
    RATE_LIMITED with a retry hint, never as a score."""

    type: Literal["rate_limited"] = Field(description="Manager type.")
    inner: str = Field(min_length=1, description="Name of the configured manager to call.")
    requests_per_minute: int | None = Field(
        None, ge=1, le=10_000_000, description="Upstream requests per minute; null: unlimited."
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=10_000_000_000,
        description="Upstream tokens per minute (response token ids when given, else ~4 "
        "characters per token); null: unlimited.",
    )
    max_wait_s: float = Field(
        10.0,
        ge=0.0,
        le=3600.0,
        description="Longest a call waits for budget before its items come back RATE_LIMITED.",
    )
    call_timeout_s: float | None = Field(
        None,
        gt=0.0,
        le=86_400.0,
        description="Deadline of one call to `inner` (waiting for budget not included); items "
        "of a call that runs longer come back TIMEOUT.",
    )

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimitedConfig:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValueError("set requests_per_minute and/or tokens_per_minute")
        return self

    def inner_managers(self) -> list[str]:
        return [self.inner]

    def build(self, name: str, context: ManagerContext) -> RateLimitedManager:
        return RateLimitedManager(name, context.manager(self.inner, wanted_by=name), self)


class RateLimitedManager(WrapperManager):
    type_name = "rate_limited"

    def __init__(self, name: str, inner: RewardManager, config: RateLimitedConfig) -> None:
        super().__init__(name, inner)
        self._config = config
        self._requests = (
            TokenBucket(config.requests_per_minute) if config.requests_per_minute else None
        )
        self._tokens = TokenBucket(config.tokens_per_minute) if config.tokens_per_minute else None
        self._lock = asyncio.Lock()  # waiters are served in arrival order

    async def _acquire(self, num_requests: int, num_tokens: int) -> None:
        needs = [
            (bucket, amount)
            for bucket, amount in ((self._requests, num_requests), (self._tokens, num_tokens))
            if bucket is not None and amount > 0
        ]
        for bucket, amount in needs:
            if amount > bucket.capacity:
                raise RateLimited(
                    f"{self.name}: one call needs {amount} units but the per-minute budget is "
                    f"{bucket.capacity:.0f}; it can never be sent (raise the limit or send "
                    "smaller requests)"
                )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.max_wait_s
        async with self._lock:
            while True:
                wait = max(bucket.wait_s(amount) for bucket, amount in needs) if needs else 0.0
                if wait == 0.0:
                    for bucket, amount in needs:
                        bucket.try_spend(amount)
                    return
                if loop.time() + wait > deadline:
                    raise RateLimited(
                        f"{self.name}: upstream budget exhausted; retry in {wait:.1f} s",
                        retry_after_s=wait,
                    )
                await asyncio.sleep(wait)

    async def _call_inner(self, items: Sequence[RewardItem]) -> list[Outcome]:
        timeout = self._config.call_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await call_batch(self.inner, items)
        except TimeoutError:
            error = ScoringTimeout(f"{self.name}: call to {self.inner.name} exceeded {timeout} s")
            return [error] * len(items)

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        if self.inner.supports_batch:
            try:
                await self._acquire(1, sum(item.approx_tokens() for item in items))
            except ScoringError as exc:
                return [exc] * len(items)
            return await self._call_inner(items)
        return list(await asyncio.gather(*(self._score_one(item) for item in items)))

    async def _score_one(self, item: RewardItem) -> Outcome:
        try:
            await self._acquire(1, item.approx_tokens())
        except ScoringError as exc:
            return exc
        return (await self._call_inner([item]))[0]


# --- dapo ------------------------------------------------------------------------------------


class DapoConfig(ManagerConfigBase):
    """DAPO's soft overlong punishment added to `inner`'s score: responses longer than
    `max_response_length - overlong_buffer_length` generated tokens lose up to
    `penalty_factor`, linearly across the buffer (DAPO, eq. 13)."""

    type: Literal["dapo"] = Field(description="Manager type.")
    inner: str = Field(min_length=1, description="Name of the configured manager that scores.")
    max_response_length: int = Field(
        ge=1, le=10_000_000, description="The rollout's max response length, in tokens."
    )
    overlong_buffer_length: int = Field(
        ge=1, le=10_000_000, description="Length of the penalty ramp before the maximum."
    )
    penalty_factor: float = Field(
        1.0, ge=0.0, le=1000.0, description="Penalty at (and beyond) the maximum length."
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> DapoConfig:
        if self.overlong_buffer_length > self.max_response_length:
            raise ValueError(
                f"overlong_buffer_length ({self.overlong_buffer_length}) must not exceed "
                f"max_response_length ({self.max_response_length})"
            )
        return self

    def inner_managers(self) -> list[str]:
        return [self.inner]

    def build(self, name: str, context: ManagerContext) -> DapoManager:
        return DapoManager(name, context.manager(self.inner, wanted_by=name), self)


class DapoManager(WrapperManager):
    type_name = "dapo"

    def __init__(self, name: str, inner: RewardManager, config: DapoConfig) -> None:
        super().__init__(name, inner)
        self._config = config

    def validate(self, item: RewardItem) -> None:
        if not item.response_token_ids:
            raise InvalidItem(
                f"item {item.item_id!r}: the dapo manager needs response_token_ids to measure "
                "the response length"
            )
        super().validate(item)

    def penalty(self, num_tokens: int) -> float:
        config = self._config
        expected = config.max_response_length - config.overlong_buffer_length
        exceed = num_tokens - expected
        if exceed <= 0:
            return 0.0
        return -min(exceed / config.overlong_buffer_length, 1.0) * config.penalty_factor

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        outcomes = await call_batch(self.inner, items)
        pairs = zip(items, outcomes, strict=True)
        return [self._penalised(item, outcome) for item, outcome in pairs]

    def _penalised(self, item: RewardItem, outcome: Outcome) -> Outcome:
        if isinstance(outcome, ScoringError):
            return outcome
        penalty = self.penalty(item.num_generated_tokens)
        components = {**outcome.components, "base": outcome.score, "overlong_penalty": penalty}
        return dataclasses.replace(outcome, score=outcome.score + penalty, components=components)
