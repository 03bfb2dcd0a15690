"""`gdpo`: several named reward components, each normalised within its group before they are
summed (GDPO's decoupled normalisation), so a component with a large scale (length, say)
cannot drown one with a small scale (correctness).

Each component is another configured manager. The pipeline hands this manager whole groups
(items sharing `group_id`; see `RewardItem.group_size` for groups that arrive in pieces).
An item whose component failed keeps that failure's status and is left out of its group's
mean and standard deviation: an infrastructure fault must not move the baseline of the
items that were really judged.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from relayrl.core.config import StrictModel
from relayrl.reward.items import RewardItem, ScoringError, Verdict
from relayrl.reward.managers.base import (
    ManagerConfigBase,
    ManagerContext,
    Outcome,
    RewardManager,
    call_batch,
)


class GdpoComponent(StrictModel):
    manager: str = Field(min_length=1, description="Configured manager scoring this component.")
    weight: float = Field(1.0, ge=-1000.0, le=1000.0, description="Weight in the final sum.")


class GdpoConfig(ManagerConfigBase):
    """Named components, normalised per component within a group, then summed with weights."""

    type: Literal["gdpo"] = Field(description="Manager type.")
    components: dict[str, GdpoComponent] = Field(
        min_length=1, description="Component name -> the manager scoring it and its weight."
    )
    normalization: Literal["mean_std", "mean"] = Field(
        "mean_std",
        description="mean_std: (x - mean) / std within the group (0 when std is 0); "
        "mean: x - mean.",
    )
    epsilon: float = Field(1e-6, gt=0.0, le=1.0, description="Added to std before dividing.")
    group_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=86_400.0,
        description="Longest the first item of a group waits for the rest (items that carry "
        "extra.group_size); the group's items then come back TIMEOUT.",
    )

    @field_validator("components")
    @classmethod
    def _names(cls, components: dict[str, GdpoComponent]) -> dict[str, GdpoComponent]:
        for name in components:
            if not name or "/" in name:
                raise ValueError(f"component name {name!r} must be non-empty without '/'")
        return components

    def inner_managers(self) -> list[str]:
        return sorted({component.manager for component in self.components.values()})

    def build(self, name: str, context: ManagerContext) -> GdpoManager:
        scorers = {
            component: (context.manager(spec.manager, wanted_by=name), spec.weight)
            for component, spec in self.components.items()
        }
        return GdpoManager(name, scorers, self)


class GdpoManager(RewardManager):
    type_name = "gdpo"
    group_aware = True
    supports_batch = True

    def __init__(
        self,
        name: str,
        components: dict[str, tuple[RewardManager, float]],
        config: GdpoConfig,
    ) -> None:
        super().__init__(name)
        self._components = components
        self._config = config
        self.group_timeout_s = config.group_timeout_s

    def validate(self, item: RewardItem) -> None:
        for manager, _ in self._components.values():
            manager.validate(item)

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        names = list(self._components)
        per_component = await asyncio.gather(
            *(call_batch(self._components[name][0], items) for name in names)
        )
        raw: list[dict[str, float] | ScoringError] = []
        for index in range(len(items)):
            outcomes = [per_component[c][index] for c in range(len(names))]
            failure = next((o for o in outcomes if isinstance(o, ScoringError)), None)
            if failure is not None:
                raw.append(failure)
            else:
                raw.append({n: o.score for n, o in zip(names, outcomes, strict=True)})  # type: ignore[union-attr]
        groups: dict[str, list[int]] = defaultdict(list)
        for index, item in enumerate(items):
            groups[item.group_id or f"\0{item.item_id}"].append(index)
        results: list[Outcome] = list(raw)  # failures stay as they are
        for members in groups.values():
            judged = [i for i in members if isinstance(raw[i], dict)]
            normalized = {
                name: self._normalize([raw[i][name] for i in judged])  # type: ignore[index]
                for name in names
            }
            for position, index in enumerate(judged):
                values: dict[str, float] = dict(raw[index])  # type: ignore[arg-type]
                total = 0.0
                for name in names:
                    norm = normalized[name][position]
                    values[f"{name}/normalized"] = norm
                    total += self._components[name][1] * norm
                results[index] = Verdict(score=total, components=values)
        return results

    def _normalize(self, values: list[float]) -> list[float]:
        if not values:
            return []
        mean = sum(values) / len(values)
        centred = [v - mean for v in values]
        if self._config.normalization == "mean":
            return centred
        std = math.sqrt(sum(c * c for c in centred) / len(values))
        if std == 0.0:
            return [0.0] * len(values)
        return [c / (std + self._config.epsilon) for c in centred]
