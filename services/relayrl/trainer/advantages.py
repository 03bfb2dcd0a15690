"""Group-relative advantages (GRPO, RLOO) and the DAPO group filter
(docs/algorithms.md#advantages, docs/algorithms.md#dapo-filter).

A group is the set of trajectories rolled out from one prompt. Each member is either valid or
an infrastructure failure (`is_infra`: the pod died, a verifier could not be reached, ...).
An infra member's reward says nothing about the policy (docs/algorithms.md#valid-members:
never record it as reward 0, or the policy learns to avoid whatever crashed the container),
so it is left out of everything: it is not part of the group's baseline or std, it gets no
advantage, and it is not trained on.

DAPO filter and refill credit
-----------------------------
A group carries no learning signal when its valid members cannot be compared
(docs/algorithms.md#dapo-filter): it has no valid member, exactly one, or all valid rewards
are equal (std 0; e.g. every answer right or every answer wrong). Its advantages would all be
0: training on it only dilutes the token denominator, so it is dropped and the prompt feeder
is told to launch replacements. DAPO's refill rule (docs/algorithms.md#refill-credit) is
`refill_credit += 2 * dapo_count + failed_count`:

- `filtered` (counted twice): groups with at least one valid member but no signal. Their
  prompt was too easy or too hard for the current policy, so a fresh prompt may well collapse
  too; DAPO over-samples, two new groups per dropped one.
- `failed` (counted once): groups with *no* valid member. In DAPO's replay buffer, "failed"
  groups are those whose rollout failed outright (nothing materialised); in relayrl a rollout
  failure is written back as an `is_infra` trajectory, so a group whose members are all infra
  is exactly that case. Its lack of signal says nothing about the prompt's difficulty, so one
  replacement suffices (and the feeder may reissue the same prompt to keep the task mix). A
  classifier that looked only at rewards would count such a group, when materialised, as a
  DAPO collapse (2x); relayrl deliberately counts it as failed (1x).

Zero std is tested as "all valid rewards are equal" (max == min), not `np.std(...) == 0.0`:
the float std of [0.1, 0.1, 0.1] is about 1e-17, not 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from relayrl.core.config import StrictModel
from relayrl.trainer.loss_config import warn_ignored_options


class AdvantageConfig(StrictModel):
    """How per-trajectory advantages are computed from a group's rewards."""

    estimator: Literal["grpo", "rloo"] = Field(
        "grpo",
        description="grpo: r - mean of the group's valid rewards (optionally / std); rloo: r - "
        "mean of the *other* valid rewards (leave-one-out baseline).",
    )
    normalize_std: bool = Field(
        True,
        description="grpo: divide by the valid rewards' sample std (n - 1) + eps; false gives "
        "Dr. GRPO's unscaled advantages. Ignored by rloo.",
    )
    eps: float = Field(
        1e-6, gt=0.0, le=1.0, description="grpo: added to the std so a tiny spread stays finite."
    )

    @model_validator(mode="after")
    def _unused(self) -> AdvantageConfig:
        if self.estimator == "rloo":
            warn_ignored_options(self, ["normalize_std", "eps"], "they apply to estimator grpo")
        return self


@dataclass(frozen=True)
class GroupRewards:
    """The scored members of one prompt group: `rewards[i]` and `is_infra[i]` of member i.
    An infra member's reward is never read (it may be anything, NaN included)."""

    uid: str
    rewards: Sequence[float]
    is_infra: Sequence[bool] = field(default=())

    def __post_init__(self) -> None:
        if not self.is_infra:
            object.__setattr__(self, "is_infra", (False,) * len(self.rewards))
        if not self.rewards:
            raise ValueError(f"group {self.uid!r} has no members")
        if len(self.rewards) != len(self.is_infra):
            raise ValueError(
                f"group {self.uid!r}: {len(self.rewards)} rewards but {len(self.is_infra)} "
                "is_infra flags"
            )
        for reward, infra in zip(self.rewards, self.is_infra, strict=True):
            if not infra and not math.isfinite(reward):
                raise ValueError(
                    f"group {self.uid!r}: valid member has reward {reward}; mark it is_infra "
                    "if it failed"
                )

    @property
    def valid_rewards(self) -> list[float]:
        """Rewards of the members that are not infra failures, in order."""
        return [float(r) for r, infra in zip(self.rewards, self.is_infra, strict=True) if not infra]


@dataclass(frozen=True)
class GroupAdvantages:
    """Per-member advantages of one group; `trainable[i]` is False for infra members, which
    get advantage 0 and must be masked out of the loss."""

    uid: str
    advantages: tuple[float, ...]
    trainable: tuple[bool, ...]


def has_signal(group: GroupRewards) -> bool:
    """At least two valid members and not all of their rewards equal
    (docs/algorithms.md#dapo-filter)."""
    valid = group.valid_rewards
    return len(valid) >= 2 and max(valid) != min(valid)


def _valid_advantages(valid: list[float], settings: AdvantageConfig) -> list[float]:
    n = len(valid)
    if n < 2 or max(valid) == min(valid):
        return [0.0] * n  # nothing to compare: exact zeros, not float noise
    mean = math.fsum(valid) / n
    if settings.estimator == "rloo":
        # r_i - (Σ_j r_j - r_i)/(n - 1) = n/(n - 1) · (r_i - mean)
        return [(r - mean) * n / (n - 1) for r in valid]
    centred = [r - mean for r in valid]
    if not settings.normalize_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + settings.eps) for c in centred]


def group_advantages(
    groups: Sequence[GroupRewards], settings: AdvantageConfig
) -> list[GroupAdvantages]:
    """Advantages of every member of every group, with baselines from the valid members only.

    grpo: A_i = (r_i - mean) / (std + eps), std the sample std (n - 1), or A_i = r_i - mean
    without normalize_std; rloo: A_i = r_i - mean_{j≠i} r_j. A group with fewer than two valid
    members or equal valid rewards gets all zeros. Infra members: advantage 0, not trainable.
    """
    result = []
    for group in groups:
        valid_iter = iter(_valid_advantages(group.valid_rewards, settings))
        advantages = tuple(0.0 if infra else next(valid_iter) for infra in group.is_infra)
        trainable = tuple(not infra for infra in group.is_infra)
        result.append(GroupAdvantages(group.uid, advantages, trainable))
    return result


@dataclass(frozen=True)
class FilterResult:
    """Outcome of `dapo_filter`: every input group is in exactly one of the three tuples."""

    kept: tuple[GroupRewards, ...]
    filtered: tuple[GroupRewards, ...]  # ≥ 1 valid member, no signal
    failed: tuple[GroupRewards, ...]  # no valid member (all infra)

    @property
    def refill_credit(self) -> int:
        """Groups the prompt feeder should launch to replace the dropped ones:
        2 · filtered + failed (module docstring; docs/algorithms.md#refill-credit)."""
        return 2 * len(self.filtered) + len(self.failed)


def dapo_filter(groups: Sequence[GroupRewards]) -> FilterResult:
    """Split groups into those with a learning signal and those without
    (docs/algorithms.md#dapo-filter)."""
    kept, filtered, failed = [], [], []
    for group in groups:
        if not group.valid_rewards:
            failed.append(group)
        elif has_signal(group):
            kept.append(group)
        else:
            filtered.append(group)
    return FilterResult(tuple(kept), tuple(filtered), tuple(failed))
