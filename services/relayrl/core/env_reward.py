"""An environment's reward: what an agent reports when it closes its session (a verifier's
score, with a status), carried to the reward-service in the trajectory's own field
(`Trajectory.env_reward`, then `RewardItem.env_reward`).

The gateway writes it (`to_proto`) from the close and from nothing else, so a label (a
group's, an opener's) is only ever a label; the reward-service's `env` manager reads it
(`from_proto` at its edges); no other scorer looks at it, so a reported reward counts only for
the data_sources an operator routes to that manager (docs/rewards.md#environment-rewards).

Status: `ok` (scored; `score` is the reward), `fail` (scored, the answer failed the
environment's check; `score` is its low reward), `error` (the environment could not score:
never a reward, the trajectory's reward is INFRA_ERROR)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from relayrl.proto.common.v1 import common_pb2

EnvRewardStatus = Literal["ok", "fail", "error"]
STATUSES: tuple[EnvRewardStatus, ...] = ("ok", "fail", "error")
MAX_MESSAGE_CHARS = 1000
MAX_ABS_SCORE = 1e6
# The proto's status numbers: the same in common.v1.EnvRewardStatus (a trajectory's, a reward
# item's) and rollout.v1.EnvRewardStatus (a CloseSessionRequest's).
_PROTO_STATUSES: dict[EnvRewardStatus, int] = {
    "ok": common_pb2.ENV_REWARD_STATUS_OK,
    "fail": common_pb2.ENV_REWARD_STATUS_FAIL,
    "error": common_pb2.ENV_REWARD_STATUS_ERROR,
}
_STATUS_OF_PROTO = {number: status for status, number in _PROTO_STATUSES.items()}


class EnvRewardMessage(Protocol):
    """common.v1.EnvReward or rollout.v1.EnvReward: the same fields and numbers."""

    status: int
    score: float
    message: str


@dataclass(frozen=True)
class EnvReward:
    status: EnvRewardStatus
    score: float = 0.0
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if not (math.isfinite(self.score) and abs(self.score) <= MAX_ABS_SCORE):
            raise ValueError(f"score must be a finite number within ±{MAX_ABS_SCORE:g}")
        if len(self.message) > MAX_MESSAGE_CHARS:
            raise ValueError(f"message is longer than {MAX_MESSAGE_CHARS} characters")

    def to_proto(self) -> common_pb2.EnvReward:
        return common_pb2.EnvReward(
            status=_PROTO_STATUSES[self.status], score=self.score, message=self.message
        )


def from_proto(message: EnvRewardMessage) -> EnvReward:
    """The reward a proto carries (a trajectory's, a reward item's or a close's). ValueError
    naming what is wrong when it is malformed (set by something other than the gateway)."""
    status = _STATUS_OF_PROTO.get(message.status)
    if status is None:
        known = message.status in common_pb2.EnvRewardStatus.values()
        got = common_pb2.EnvRewardStatus.Name(message.status) if known else message.status
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {got}")
    return EnvReward(status, message.score, message.message)
