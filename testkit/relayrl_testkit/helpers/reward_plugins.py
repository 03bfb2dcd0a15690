"""Reward plug-ins loaded by the reward-service processes of the integration tests (the
service imports them by dotted path, as it would a team's own scorer)."""

from __future__ import annotations

import asyncio

from relayrl.reward.items import (
    InfraError,
    InvalidItem,
    RateLimited,
    RewardItem,
    ScoringTimeout,
    Status,
    Verdict,
)


async def by_id(item: RewardItem) -> Verdict:
    """The item id chooses the outcome; `extra.sleep_s` delays it."""
    await asyncio.sleep(float(item.extra.get("sleep_s", "0")))
    kind = item.item_id.split("-")[0]
    if kind == "infra":
        raise InfraError("judge unreachable")
    if kind == "timeout":
        raise ScoringTimeout("judge too slow")
    if kind == "ratelimited":
        raise RateLimited("upstream 429", retry_after_s=2.0)
    if kind == "invalid":
        raise InvalidItem("no ground truth")
    if kind == "crash":
        raise RuntimeError("scorer bug")
    if kind == "policy":
        return Verdict(0.0, Status.POLICY_FAIL, message="wrong answer")
    return Verdict(float(len(item.response)))
