"""An environment's reward: what an agent reports when it closes its session (a verifier's
score, with a status), carried to the reward-service on the trajectory's labels.

The gateway writes it (`to_labels`) and the reward-service's `env` manager reads it
(`from_labels`); no other scorer looks at it, so a reported reward counts only for the
data_sources an operator routes to that manager (docs/rewards.md#environment-rewards).

Status: `ok` (scored; `score` is the reward), `fail` (scored, the answer failed the
environment's check; `score` is its low reward), `error` (the environment could not score:
never a reward, the trajectory's reward is INFRA_ERROR)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

EnvRewardStatus = Literal["ok", "fail", "error"]
STATUSES: tuple[EnvRewardStatus, ...] = ("ok", "fail", "error")
SCORE_LABEL = "env_reward"
STATUS_LABEL = "env_reward_status"
MESSAGE_LABEL = "env_reward_message"
LABELS = (SCORE_LABEL, STATUS_LABEL, MESSAGE_LABEL)
MAX_MESSAGE_CHARS = 1000
MAX_ABS_SCORE = 1e6


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

    def to_labels(self) -> dict[str, str]:
        labels = {SCORE_LABEL: repr(float(self.score)), STATUS_LABEL: self.status}
        if self.message:
            labels[MESSAGE_LABEL] = self.message
        return labels


def from_labels(labels: Mapping[str, str]) -> EnvReward | None:
    """The reported reward on a trajectory's labels; None when none was reported. ValueError
    when the labels are malformed (written by something other than the gateway)."""
    if STATUS_LABEL not in labels:
        if SCORE_LABEL in labels:
            raise ValueError(f"label {SCORE_LABEL} without {STATUS_LABEL}")
        return None
    try:
        score = float(labels.get(SCORE_LABEL, "0"))
    except ValueError:
        raise ValueError(f"label {SCORE_LABEL} is not a number: {labels[SCORE_LABEL]!r}") from None
    return EnvReward(labels[STATUS_LABEL], score, labels.get(MESSAGE_LABEL, ""))  # type: ignore[arg-type]
