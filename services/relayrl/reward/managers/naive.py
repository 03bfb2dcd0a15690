"""The `naive` manager: scores each item with the rule scorer of its `data_source` (GSM8K,
MATH, arithmetic; see `rules.py`). Rule scorers are pure and fast, so they run inline in the
event loop; there is no backend to batch for.

An item whose data_source has no rule scorer is never scored 0: with `unknown_source: error`
(the default) it is rejected before it is queued, naming the data_source and the known ones;
with `warn` it is accepted and comes back INVALID_INPUT, with one warning logged per unknown
source (a misconfigured dataset sends thousands).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from relayrl.reward.items import InvalidItem, RewardItem, Verdict
from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, RewardManager
from relayrl.reward.managers.rules import RULE_SCORERS, RuleScorer, score_math

logger = logging.getLogger(__name__)

# Unknown data sources remembered for the once-per-source warning; beyond this many (garbage
# data_source values) further ones are not warned about individually.
MAX_WARNED_SOURCES = 1024


def _known_list(sources: Iterable[str]) -> str:
    return ", ".join(sorted(sources)) or "none"


class NaiveConfig(ManagerConfigBase):
    """`type: naive`: rule-based scoring by data_source (GSM8K, MATH, arith)."""

    type: Literal["naive"] = Field(description="Manager type.")
    data_sources: list[str] | None = Field(
        None,
        min_length=1,
        max_length=len(RULE_SCORERS),
        description="Rule scorers this manager offers, by data_source (keys of the rule "
        "table: gsm8k, openai/gsm8k, math, lighteval/MATH, math_dapo, arith, ...); null: all "
        "of them.",
    )
    default_source: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="data_source used for an item that has none; null: such an item is an "
        "unknown source.",
    )
    unknown_source: Literal["warn", "error"] = Field(
        "error",
        description="An item whose data_source has no rule scorer: `error` rejects it before "
        "it is queued (the caller gets INVALID_ARGUMENT naming the data_source); `warn` "
        "accepts it, logs one warning per source and returns it INVALID_INPUT. Never a 0 "
        "score.",
    )

    @field_validator("data_sources")
    @classmethod
    def _known_sources(cls, sources: list[str] | None) -> list[str] | None:
        if sources is None:
            return None
        unknown = [source for source in sources if source not in RULE_SCORERS]
        if unknown:
            raise ValueError(
                f"no rule scorer for data_source {', '.join(map(repr, unknown))} "
                f"(known: {_known_list(RULE_SCORERS)})"
            )
        if len(set(sources)) != len(sources):
            raise ValueError("data_sources lists a source twice")
        return sources

    @model_validator(mode="after")
    def _known_default(self) -> NaiveConfig:
        if self.default_source is None:
            return self
        offered = self.data_sources if self.data_sources is not None else RULE_SCORERS
        if self.default_source not in offered:
            raise ValueError(
                f"default_source {self.default_source!r} is not one of this manager's data "
                f"sources (known: {_known_list(offered)})"
            )
        return self

    def build(self, name: str, context: ManagerContext) -> NaiveManager:
        return NaiveManager(name, self)


class NaiveManager(RewardManager):
    """Dispatches each item to the rule scorer of its data_source."""

    type_name = "naive"

    def __init__(self, name: str, config: NaiveConfig) -> None:
        super().__init__(name)
        sources = config.data_sources if config.data_sources is not None else RULE_SCORERS
        self._scorers: dict[str, RuleScorer] = {source: RULE_SCORERS[source] for source in sources}
        self._default_source = config.default_source
        self._unknown_source = config.unknown_source
        self._warned: set[str] = set()

    @property
    def data_sources(self) -> tuple[str, ...]:
        return tuple(self._scorers)

    def _scorer(self, item: RewardItem) -> RuleScorer:
        """The item's rule scorer; InvalidItem naming the data_source when there is none."""
        source = item.data_source or self._default_source
        scorer = self._scorers.get(source) if source else None
        if scorer is not None:
            return scorer
        if source:
            problem = f"no rule scorer for data_source {source!r}"
        else:
            problem = "data_source is empty and this manager has no default_source"
        raise InvalidItem(
            f"item {item.item_id!r}: {problem} (manager {self.name!r} knows: "
            f"{_known_list(self._scorers)})"
        )

    def validate(self, item: RewardItem) -> None:
        if self._unknown_source == "error":
            self._scorer(item)
        if not item.ground_truth.strip():
            raise InvalidItem(
                f"item {item.item_id!r}: ground_truth is empty; rule scorers compare the "
                "response with it"
            )

    async def score(self, item: RewardItem) -> Verdict:
        try:
            scorer = self._scorer(item)
        except InvalidItem as exc:
            if self._unknown_source == "warn":
                self._warn_once(item.data_source or "", exc.message)
            raise
        if scorer is score_math:
            # Symbolic equivalence may take a sizeable fraction of a second (sympy): keep it
            # off the event loop that serves every other caller.
            return await asyncio.to_thread(scorer, item)
        return scorer(item)

    def _warn_once(self, source: str, message: str) -> None:
        if source in self._warned or len(self._warned) > MAX_WARNED_SOURCES:
            return
        self._warned.add(source)
        if len(self._warned) > MAX_WARNED_SOURCES:
            logger.warning(
                "manager %r: over %d unknown data sources; not warning about more",
                self.name,
                MAX_WARNED_SOURCES,
            )
            return
        logger.warning(
            "%s; items of this data_source come back INVALID_INPUT (warned once per source)",
            message,
        )
