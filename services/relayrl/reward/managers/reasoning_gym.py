"""`reasoning_gym`: scores items of reasoning-gym tasks with the package's own checkers, so any
team can score reasoning-gym items over gRPC as relayrl's trainer does.

An item's data_source is `reasoning_gym:<dataset>` and its ground truth is the JSON that
relayrl.tasks.reasoning_gym writes: `{"answer": ..., "metadata": {...}}` (the item as the
package generated it). The response's answer is the text of its last `<answer>...</answer>`;
none is a wrong answer (POLICY_FAIL, 0), never an infrastructure failure. The checker's score
(in [0, 1]; some datasets give partial credit) is the reward: OK at 1.0, POLICY_FAIL below.

A data_source outside reasoning-gym's datasets, or a ground truth that is not that JSON, is
refused before the item is queued (INVALID_ARGUMENT naming it), never scored 0.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from relayrl.reward.items import InvalidItem, RewardItem, Status, Verdict
from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, RewardManager

PREFIX = "reasoning_gym:"


class ReasoningGymConfig(ManagerConfigBase):
    """`type: reasoning_gym`: reasoning-gym's answer checkers, by data_source
    `reasoning_gym:<dataset>`."""

    type: Literal["reasoning_gym"] = Field(description="Manager type.")
    answer_tag: str = Field(
        "answer",
        pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$",
        description="The response's answer is inside the last <answer_tag>...</answer_tag>.",
    )

    def build(self, name: str, context: ManagerContext) -> ReasoningGymManager:
        return ReasoningGymManager(name, self.answer_tag)


@functools.cache
def _checker(dataset: str) -> Callable[[Any, dict[str, Any]], float]:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        raise KeyError(dataset)
    return reasoning_gym.get_score_answer_fn(dataset)


def parse(item: RewardItem) -> tuple[str, dict[str, Any]]:
    """(dataset, entry) of an item; InvalidItem naming what is wrong."""
    if not item.data_source.startswith(PREFIX):
        raise InvalidItem(
            f"item {item.item_id!r}: data_source {item.data_source!r} is not {PREFIX}<dataset>"
        )
    dataset = item.data_source.removeprefix(PREFIX)
    try:
        _checker(dataset)
    except KeyError:
        raise InvalidItem(
            f"item {item.item_id!r}: reasoning-gym has no dataset {dataset!r}"
        ) from None
    try:
        entry = json.loads(item.ground_truth)
    except ValueError:
        entry = None
    if not isinstance(entry, dict) or "answer" not in entry:
        raise InvalidItem(
            f"item {item.item_id!r}: the ground truth must be the JSON "
            '{"answer": ..., "metadata": {...}} of a reasoning-gym item'
        )
    entry.setdefault("metadata", {})
    return dataset, entry


def score_item(item: RewardItem, answer_tag: str = "answer") -> Verdict:
    """The checker's verdict on one item (blocking: checkers may take a while)."""
    from reasoning_gym.utils import extract_answer

    dataset, entry = parse(item)
    answer = extract_answer(item.response, tag_name=answer_tag)
    if answer is None:
        return Verdict(0.0, Status.POLICY_FAIL, message=f"no <{answer_tag}> in the response")
    try:
        score = float(_checker(dataset)(answer, entry))
    except Exception as exc:  # a checker that cannot parse the answer: the answer is wrong
        return Verdict(0.0, Status.POLICY_FAIL, message=f"the checker refused the answer: {exc}")
    status = Status.OK if score >= 1.0 else Status.POLICY_FAIL
    return Verdict(score, status, message=f"answer {answer[:80]!r} scored {score:g}")


class ReasoningGymManager(RewardManager):
    type_name = "reasoning_gym"

    def __init__(self, name: str, answer_tag: str) -> None:
        super().__init__(name)
        self._answer_tag = answer_tag

    def validate(self, item: RewardItem) -> None:
        parse(item)

    async def score(self, item: RewardItem) -> Verdict:
        return await asyncio.to_thread(score_item, item, self._answer_tag)
