"""A user's reward plug-ins, as an operator would install them: imported by dotted path."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.reward.items import InvalidItem, RewardItem, Verdict
from relayrl.reward.managers.base import Outcome, RewardManager


def length_score(item: RewardItem) -> float:
    return float(len(item.response))


async def async_verdict(item: RewardItem) -> Verdict:
    return Verdict(1.0 if item.response == item.ground_truth else 0.0)


def returns_garbage(item: RewardItem) -> str:
    return "not a score"


class KeywordManager(RewardManager):
    """Counts a keyword; rejects items without a response up front."""

    supports_batch = True

    def __init__(self, name: str, *, keyword: str) -> None:
        super().__init__(name)
        self.keyword = keyword

    def validate(self, item: RewardItem) -> None:
        if not item.response:
            raise InvalidItem("empty response")

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        return [Verdict(float(item.response.count(self.keyword))) for item in items]


NOT_CALLABLE = 42
