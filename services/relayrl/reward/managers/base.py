"""The reward-manager contract: what every scorer (built-in or a user's, by dotted path)
implements, and the config base every manager type's config section derives from.

A manager scores items; the pipeline around it owns queueing, micro-batching, concurrency,
deadlines and result assembly. A manager:
- implements `score(item)` (one item) and/or `score_batch(items)` (one backend request for many
  items; set `supports_batch = True` when it really is one request);
- returns a `Verdict` for an item it could judge, and raises (or, from `score_batch`, returns in
  that item's place) a `ScoringError` for one it could not: never a score of 0 for a failure;
- may reject malformed items before they are queued by overriding `validate`;
- is built from its config section by `ManagerConfig.build(name, context)`, inside the service's
  event loop, and is closed once with `close()`.

`score_batch` returning one entry per item, in order, is the contract the pipeline checks; a
manager that returns the wrong number of entries has a bug and its whole call becomes
INFRA_ERROR with a message saying so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from relayrl.core.config import StrictModel
from relayrl.reward.items import InfraError, RewardItem, ScoringError, ScoringTimeout, Verdict

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

Outcome = Verdict | ScoringError


class BatchingConfig(StrictModel):
    """How items reach one manager's backend (`batching:` of a manager, or the pipeline's
    default). Items that arrive one at a time are held until `micro_batch_size` items are
    waiting or the oldest has waited `micro_batch_timeout_ms`, then sent as one call, with at
    most `max_inflight_calls` calls running.

    There is deliberately no "send at once while a slot is free" mode: a burst would then
    fill every slot with one-item calls and the rest of the burst would wait a whole call
    duration. The timeout bounds what an item can lose instead: bench/reward_bench.py's
    last-arriving item waits at most micro_batch_timeout_ms before its request starts."""

    micro_batch_size: int = Field(
        0,
        ge=0,
        le=4096,
        description="Most items per backend call formed from separate arrivals; 0 turns "
        "micro-batching off (each submission is split into chunks across the workers, as "
        "the reference pipeline does: docs/rewards.md#micro-batching).",
    )
    micro_batch_timeout_ms: float = Field(
        200.0,
        ge=0.0,
        le=600_000.0,
        description="Longest an item waits for a micro-batch to fill before it is sent anyway.",
    )
    max_inflight_calls: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Most backend calls of this manager running at once; null: the "
        "pipeline's num_workers.",
    )


class ManagerConfigBase(StrictModel):
    """Fields every manager type has. A subclass adds `type: Literal["<name>"]`, its own
    fields, and `build(self, name: str, context: ManagerContext) -> RewardManager`, which
    imports the manager's heavy dependencies (so parsing a config stays instant)."""

    description: str = Field("", description="Shown to callers by ListManagers.")
    timeout_s: float | None = Field(
        None,
        gt=0.0,
        le=86_400.0,
        description="Deadline of one backend call; items of a call that runs longer come back "
        "TIMEOUT. null: no per-call deadline (the caller's deadline still applies).",
    )
    batching: BatchingConfig | None = Field(
        None, description="Micro-batching for this manager; null: the pipeline's default."
    )

    def inner_managers(self) -> list[str]:
        """Names of other configured managers this one wraps (built first)."""
        return []


@dataclass
class ManagerContext:
    """What a manager may use while it is built: the managers built before it (the ones it
    wraps), and the service's metric registry."""

    managers: Mapping[str, RewardManager] = field(default_factory=dict)
    registry: CollectorRegistry | None = None

    def manager(self, name: str, *, wanted_by: str) -> RewardManager:
        try:
            return self.managers[name]
        except KeyError:
            raise ValueError(
                f"manager {wanted_by!r} wraps {name!r}, which is not configured "
                f"(configured: {', '.join(sorted(self.managers)) or 'none'})"
            ) from None


class RewardManager:
    """Base of every manager. Subclasses override `score` or `score_batch` (or both); a class
    that overrides neither is refused when it is instantiated."""

    # Whether score_batch sends one backend request for many items (reported by ListManagers;
    # the pipeline micro-batches any manager, but only batching ones save requests).
    supports_batch: ClassVar[bool] = False
    # Whether items must reach score_batch together with the rest of their group (gdpo).
    group_aware: ClassVar[bool] = False
    # Manager type name, as in the config table.
    type_name: ClassVar[str] = "custom"

    def __init__(self, name: str, *, max_concurrent: int = 64) -> None:
        cls = type(self)
        if cls.score is RewardManager.score and cls.score_batch is RewardManager.score_batch:
            raise TypeError(f"{cls.__name__} must override score() or score_batch()")
        self.name = name
        self._max_concurrent = max_concurrent

    @property
    def data_sources(self) -> tuple[str, ...]:
        """data_source values this manager knows (empty: any)."""
        return ()

    def validate(self, item: RewardItem) -> None:
        """Raise `InvalidItem` for an item this manager can never score, before it is queued
        (the caller then gets INVALID_ARGUMENT naming the item)."""

    async def score(self, item: RewardItem) -> Verdict:
        """Score one item, or raise a ScoringError."""
        outcome = (await self.score_batch([item]))[0]
        if isinstance(outcome, ScoringError):
            raise outcome
        return outcome

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        """Score `items` (one entry per item, in order). Default: `score` per item, at most
        `max_concurrent` at once; an item's failure does not fail the others."""
        semaphore = asyncio.Semaphore(self._max_concurrent)

        async def one(item: RewardItem) -> Outcome:
            async with semaphore:
                return await outcome_of(self.score(item))

        return list(await asyncio.gather(*(one(item) for item in items)))

    async def close(self) -> None:
        """Release connections, processes, files. Called once at shutdown."""


async def outcome_of(call: asyncio.Future[Verdict] | object) -> Outcome:
    """Await a scoring coroutine and turn its failure into the item's ScoringError: a
    ScoringError stays itself, a timeout becomes TIMEOUT, anything else is the scorer's
    infrastructure failing (INFRA_ERROR, with the exception named)."""
    try:
        verdict = await call  # type: ignore[misc]
    except ScoringError as exc:
        return exc
    except TimeoutError as exc:
        return ScoringTimeout(str(exc) or "the scorer did not answer in time")
    except Exception as exc:
        return InfraError(f"{type(exc).__name__}: {exc}")
    if not isinstance(verdict, Verdict):
        return InfraError(
            f"the manager returned {type(verdict).__name__}, not a Verdict (a scorer bug)"
        )
    return verdict


async def call_batch(manager: RewardManager, items: Sequence[RewardItem]) -> list[Outcome]:
    """`manager.score_batch(items)` with its contract enforced: one Outcome per item. A call
    that raises fails every item of it (a ScoringError keeps its status, a timeout is
    TIMEOUT, anything else INFRA_ERROR); a malformed answer is the manager's bug and is
    INFRA_ERROR for every item, never a silent misalignment of scores and items."""
    try:
        outcomes = await manager.score_batch(items)
    except ScoringError as exc:
        return [exc] * len(items)
    except TimeoutError as exc:
        return [ScoringTimeout(str(exc) or f"{manager.name} did not answer in time")] * len(items)
    except Exception as exc:
        return [InfraError(f"{manager.name}: {type(exc).__name__}: {exc}")] * len(items)
    if not isinstance(outcomes, list) or len(outcomes) != len(items):
        got = len(outcomes) if isinstance(outcomes, list) else type(outcomes).__name__
        error = InfraError(
            f"{manager.name}: score_batch returned {got} outcomes for {len(items)} items "
            "(a manager bug)"
        )
        return [error] * len(items)
    return [
        outcome
        if isinstance(outcome, Verdict | ScoringError)
        else InfraError(
            f"{manager.name}: score_batch returned {type(outcome).__name__}, not a Verdict "
            "(a manager bug)"
        )
        for outcome in outcomes
    ]
