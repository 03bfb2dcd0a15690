"""The settings of the trainer's policy loss (docs/algorithms.md): PPO clipping, importance
weights, rejection rules, the reference KL and the aggregation. They are part of the trainer's
config, so validating a config (`--print-config`, a Helm check) imports this module and not
torch; relayrl.trainer.losses computes what they describe."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from relayrl.core.config import StrictModel

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]


def warn_ignored_options(model: StrictModel, names: Sequence[str], reason: str) -> None:
    """Warn about options of `model` set explicitly (not defaulted) that its chosen mode does
    not read, so a config that looks effective but is not gets noticed."""
    unused = [name for name in names if name in model.model_fields_set]
    if unused:
        warnings.warn(f"{', '.join(unused)} ignored: {reason}", UserWarning, stacklevel=2)


class ClipConfig(StrictModel):
    """PPO clipping of rho = π_θ/π_old (asymmetric, DAPO's clip-higher), with an optional dual
    clip for negative advantages (Ye et al., 2020)."""

    eps_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="rho is clipped below at 1 - eps_low (for Â < 0)."
    )
    eps_high: float = Field(
        0.28, ge=0.0, le=10.0, description="rho is clipped above at 1 + eps_high (for Â > 0)."
    )
    dual_clip_c: float | None = Field(
        None,
        description="Dual clip: for Â < 0 the per-token loss is capped at c·|Â|, so a huge rho "
        "on a bad token cannot dominate the step; null: off. Must exceed 1 + eps_high.",
    )

    @model_validator(mode="after")
    def _dual_clip_outside_trust_region(self) -> ClipConfig:
        c = self.dual_clip_c
        if c is not None and not (math.isfinite(c) and c > 1.0 + self.eps_high):
            raise ValueError(
                f"dual_clip_c ({c}) must be a number greater than 1 + eps_high "
                f"({1.0 + self.eps_high:g}); below that it cuts inside the trust region"
            )
        return self


class ISConfig(StrictModel):
    """Importance weights w = π_old/μ that correct for the behaviour policy
    (docs/algorithms.md#importance-weights). `none` leaves w = 1 but the raw weights are still
    measured."""

    kind: Literal["none", "tis", "icepop"] = Field(
        "none",
        description="none: w = 1; tis: truncated IS, w = min(π_old/μ, cap); icepop: masked IS, "
        "w = π_old/μ inside [alpha, beta], else 0.",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one weight per token; sequence: one weight per sequence, the exp "
        "of the (clamped) sum of its tokens' log ratios, given to each of its tokens.",
    )
    cap: float = Field(2.0, ge=1.0, le=1e6, description="tis: the truncation cap C (verl uses 2).")
    alpha: float = Field(
        0.5, ge=0.0, le=1e6, description="icepop: lower end of the kept interval of w (<= 1)."
    )
    beta: float = Field(
        5.0, gt=0.0, le=1e6, description="icepop: upper end of the kept interval of w (>= 1)."
    )
    log_ratio_clamp: float = Field(
        20.0,
        gt=0.0,
        le=50.0,
        description="Safety clamp on the log ratio (token) or its sum (sequence) before exp, "
        "so an extreme mismatch gives a large finite weight instead of inf.",
    )
    batch_normalize: bool = Field(
        False,
        description="Divide the weights by their mean over the batch's tokens (token level) or "
        "sequences (sequence level), so they average 1 and the effective step size stays put.",
    )

    @model_validator(mode="after")
    def _interval_and_unused(self) -> ISConfig:
        if self.alpha >= self.beta:
            raise ValueError(
                f"icepop interval is empty: alpha ({self.alpha}) must be less than beta "
                f"({self.beta})"
            )
        if not self.alpha <= 1.0 <= self.beta:
            raise ValueError(
                f"icepop interval [{self.alpha}, {self.beta}] must contain 1, else tokens where "
                "π_old = μ would be zeroed"
            )
        if self.kind != "tis":
            warn_ignored_options(self, ["cap"], f"cap applies to kind tis, not {self.kind}")
        if self.kind != "icepop":
            warn_ignored_options(
                self, ["alpha", "beta"], f"they apply to kind icepop, not {self.kind}"
            )
        if self.kind == "none" and self.batch_normalize:
            warn_ignored_options(self, ["batch_normalize"], "kind none has every weight at 1")
        return self


class RejectionRule(StrictModel):
    """One rejection test on the behaviour mismatch (docs/algorithms.md#rejection-masks): a
    token (or a whole sequence) is kept only if its statistic lies in [low, high]. Statistics,
    with log r = log π_old - log μ: k1 = -log r, k2 = ½ (log r)², k3 = r - 1 - log r (nats).
    Example: keep tokens with π_old/μ in [0.5, 2]:
    `{metric: k1, level: token, low: -0.693, high: 0.693}`."""

    metric: KLEstimator = Field(description="The statistic: k1, k2 or k3 (see above).")
    level: Literal["token", "sequence"] = Field(
        description="token: drop single tokens; sequence: reduce over the sequence's trained "
        "tokens and drop the whole sequence."
    )
    reduce: Literal["sum", "mean", "max"] | None = Field(
        None,
        description="sequence level: how the token statistics of a sequence are reduced "
        "(required there, not allowed at token level).",
    )
    low: float | None = Field(
        None, allow_inf_nan=False, description="Keep if statistic >= low; null: no lower bound."
    )
    high: float | None = Field(
        None, allow_inf_nan=False, description="Keep if statistic <= high; null: no upper bound."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RejectionRule:
        if self.level == "sequence" and self.reduce is None:
            raise ValueError("a sequence-level rule needs reduce: sum, mean or max")
        if self.level == "token" and self.reduce is not None:
            raise ValueError(
                f"reduce ({self.reduce}) only applies at sequence level; drop it or set "
                "level: sequence"
            )
        if self.low is None and self.high is None:
            raise ValueError("a rejection rule needs low, high or both")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high}): nothing is kept")
        return self

    @property
    def label(self) -> str:
        """Short name (docs/algorithms.md#rejection-masks): `token_k1`, `seq_mean_k3`, ..."""
        return (
            f"token_{self.metric}" if self.level == "token" else f"seq_{self.reduce}_{self.metric}"
        )


# Rules are AND-ed: a token is trained on only if every rule keeps it.
RejectionRules = list[RejectionRule]


class LossConfig(StrictModel):
    """The policy loss of one update (docs/algorithms.md#decoupled-ppo)."""

    aggregation: Aggregation = Field(
        "token-mean",
        description="token-mean: every trained token weighs the same; seq-mean-token-mean: "
        "every sequence weighs the same (its tokens averaged); seq-mean-token-sum: every "
        "sequence weighs the same, its tokens summed (Dr. GRPO-style, length-unbiased).",
    )
    clip: ClipConfig = Field(default_factory=ClipConfig, description="PPO clipping.")
    importance_sampling: ISConfig = Field(
        default_factory=ISConfig, description="Behaviour-policy weights w = π_old/μ."
    )
    rejection: RejectionRules = Field(
        default_factory=list,
        description="Rejection rules on the π_old/μ mismatch, AND-ed; rejected tokens leave the "
        "response mask. Empty: none.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Weight of the per-token KL penalty to the reference policy; 0: off (no "
        "reference forward pass is needed).",
    )
    kl_estimator: KLEstimator = Field(
        "k3", description="Estimator of KL(π_θ ‖ π_ref) per token: k1, k2 or k3 (low variance)."
    )

    @model_validator(mode="after")
    def _unused(self) -> LossConfig:
        if self.kl_coef == 0.0:
            warn_ignored_options(self, ["kl_estimator"], "kl_coef is 0")
        return self
