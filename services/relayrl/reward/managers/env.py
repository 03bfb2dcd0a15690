"""`env`: the reward an environment reported itself (an agent's close, relayrl.core.env_reward),
alone or added to another manager's score (docs/rewards.md#environment-rewards).

The reported reward is the item's own `env_reward` (a trajectory's, which only the gateway
writes from an agent's close; a gRPC caller sets the same field), never its `extra` or labels.
Its status decides: `ok` and `fail` are rewards (OK, POLICY_FAIL), `error` is INFRA_ERROR with
the environment's message. An item that reports nothing is refused before it is queued
(INVALID_ARGUMENT), never scored 0.

With `add: <manager>`, the item is also scored by that manager and the reward is the sum
(components `env` and the manager's name): a verifier's format or efficiency score next to a
rule scorer's correctness, say. Either part failing to score fails the item with that part's
status; the result is POLICY_FAIL when either part is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.core.env_reward import EnvReward
from relayrl.reward.items import InfraError, InvalidItem, RewardItem, ScoringError, Status, Verdict
from relayrl.reward.managers.base import (
    ManagerConfigBase,
    ManagerContext,
    RewardManager,
    call_batch,
)


class EnvConfig(ManagerConfigBase):
    """`type: env`: the environment's own reported reward (an agent's close), optionally
    added to another manager's score."""

    type: Literal["env"] = Field(description="Manager type.")
    add: str | None = Field(
        None,
        min_length=1,
        description="Name of a configured manager whose score is added to the environment's; "
        "null: the environment's reward alone.",
    )

    def inner_managers(self) -> list[str]:
        return [self.add] if self.add else []

    def build(self, name: str, context: ManagerContext) -> EnvManager:
        added = context.manager(self.add, wanted_by=name) if self.add else None
        if added is not None and added.group_aware:
            raise ValueError(
                f"managers.{name}.add: {self.add!r} normalises whole groups; add a per-item scorer"
            )
        return EnvManager(name, added)


def reported(item: RewardItem) -> EnvReward:
    """The item's reported reward; InvalidItem when it has none (a malformed one is refused at
    the edge, relayrl.reward.convert.reported_reward)."""
    reward = item.env_reward
    if reward is None:
        raise InvalidItem(
            f"item {item.item_id!r} reports no environment reward (its agent closed without "
            "`env_reward`); route its data_source to a scorer that needs none"
        )
    return reward


class EnvManager(RewardManager):
    type_name = "env"

    def __init__(self, name: str, added: RewardManager | None) -> None:
        super().__init__(name)
        self._added = added

    def validate(self, item: RewardItem) -> None:
        reported(item)
        if self._added is not None:
            self._added.validate(item)

    async def score(self, item: RewardItem) -> Verdict:
        env = reported(item)
        if env.status == "error":
            raise InfraError(f"the environment could not score: {env.message or 'no reason'}")
        status = Status.OK if env.status == "ok" else Status.POLICY_FAIL
        if self._added is None:
            return Verdict(env.score, status, components={"env": env.score}, message=env.message)
        (other,) = await call_batch(self._added, [item])
        if isinstance(other, ScoringError):
            raise other
        if other.status == Status.POLICY_FAIL:
            status = Status.POLICY_FAIL
        return Verdict(
            env.score + other.score,
            status,
            components={"env": env.score, self._added.name: other.score},
            message="; ".join(m for m in (env.message, other.message) if m),
        )
