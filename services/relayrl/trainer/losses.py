"""The policy loss of the trainer: off-policy correction, rejection masks, decoupled PPO,
reference KL, aggregation under a global denominator, and the train/inference mismatch
metrics (docs/algorithms.md); their settings are in relayrl.trainer.loss_config. Pure torch, no
megatron: every function takes padded `[B, T]` tensors and a response mask and can be checked
by hand on tiny inputs.

Tensors and conventions
-----------------------
- `mask_BT`: bool or 0/1 float; 1 marks a token that is trained on (a generated response
  token), 0 marks prompt, observation and padding positions. Values at masked-out positions
  of every other tensor are never read (they may be garbage, even NaN or ±inf, without
  leaking into losses, gradients or metrics).
- `logp_BT`: log π_θ of the sampled tokens (the current policy, with gradient);
  `old_logp_BT`: log π_old, recomputed by the trainer at the start of the update
  (docs/algorithms.md#order-of-a-step);
  `rollout_logp_BT`: log μ, returned by the inference engine (the behaviour policy);
  `ref_logp_BT`: log π_ref of a frozen reference policy.
- The behaviour log ratio is `log r = old_logp - rollout_logp = log(π_old / μ)`
  (docs/algorithms.md#importance-weights). With samples drawn from μ, the
  estimators of Schulman, "Approximating KL divergence" (2020), with q = μ, p = π_old are
  k1 = -log r, k2 = ½ (log r)², k3 = r - 1 - log r; each estimates KL(μ ‖ π_old)
  (docs/algorithms.md#rejection-masks).

The decoupled objective (AReaL; docs/algorithms.md#decoupled-ppo): the behaviour weight w =
π_old/μ corrects *which distribution sampled the data* and is a constant (detached); the PPO
ratio rho = π_θ/π_old bounds *how far this update moves*:

    L = -E_μ[ w · min(rho Â, clip(rho, 1 - ε_low, 1 + ε_high) Â) ].

The global denominator contract (docs/algorithms.md#global-denominator)
--------------------------------------------
A step's batch is split over data-parallel ranks and, on each rank, over micro-batches; the
gradient is accumulated over all of them. Dividing each micro-batch by its *own* token count
(a local mean) weighs a token in a short micro-batch more than one in a long one, and the
result depends on how the batch happened to be split. Here the denominator is an input:

1. Before the forward-backward passes, every rank computes `loss_denominator(mask, mode)` for
   each of its micro-batches and sums them; the ranks all-reduce (SUM) that number over the
   data-parallel group. That is the step's global denominator `D`.
2. Each micro-batch then backpropagates `aggregate(L_BT, mask, mode, D)`, its *contribution*
   (the sum over its rows divided by D), and the contributions' gradients are summed, never
   averaged: gradient accumulation adds them, and the data-parallel gradient reduction must
   be a SUM (or, if the DDP wrapper averages over `dp_size` ranks, the caller multiplies the
   contribution by `dp_size`).

Then the sum of the contributions over any split equals the full-batch loss exactly, and so
does the gradient. With context parallelism, count each token once (not once per CP rank).
A global denominator of 0 (nothing to train) is treated as 1, as megatron's
`finalize_model_grads` does, so an empty step gives a zero loss instead of NaN.

Metrics are plain Python floats (one host sync per call); names are listed in each docstring.
Per-micro-batch metrics come with their token count so a caller can weight them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from relayrl.trainer.loss_config import (
    Aggregation,
    ClipConfig,
    ISConfig,
    KLEstimator,
    LossConfig,
    RejectionRule,
)

# exp() of a log ratio beyond this is clamped where nothing configures it (the PPO ratio rho,
# the k3 reference penalty): e^20 ≈ 4.9e8 is far outside any useful ratio, yet finite.
SAFETY_LOG_RATIO = 20.0


# --- helpers ---------------------------------------------------------------------------------


def _check_shapes(mask_BT: Tensor, **tensors: Tensor | None) -> None:
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be [B, T], got shape {tuple(mask_BT.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask_BT.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but mask_BT has {tuple(mask_BT.shape)}"
            )


def _float_dtype(tensor: Tensor) -> torch.dtype:

    return torch.promote_types(tensor.dtype, torch.float32)


def _behaviour_log_ratio(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, keep_BT: Tensor, dtype: torch.dtype
) -> Tensor:
    """log r = old_logp - rollout_logp at trained tokens, 0 elsewhere; detached."""

    diff = old_logp_BT.detach().to(dtype) - rollout_logp_BT.detach().to(dtype)
    return torch.where(keep_BT, diff, torch.zeros((), dtype=dtype, device=diff.device))


def _masked(tensor: Tensor, keep: Tensor) -> Tensor:
    """`tensor` with masked-out positions replaced by 0 *before* any arithmetic, so garbage
    there (NaN, inf) cannot reach a result or, through 0·inf, a gradient."""

    return torch.where(keep, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def _frac(flags: Tensor, keep: Tensor) -> float:
    """Fraction of the kept positions where `flags` holds; 0.0 when none are kept."""
    total = int(keep.sum())
    return float((flags & keep).sum()) / total if total else 0.0


def _mean(values: Tensor, keep: Tensor) -> float:
    total = int(keep.sum())
    return float(_masked(values, keep).double().sum()) / total if total else 0.0


def _ess(weights: Tensor) -> float:
    """Normalised effective sample size (Σw)² / (N Σw²) in (0, 1]; 1 when all weights are
    equal, 0 when every weight is 0 or there are none."""
    w = weights.double()
    square_sum = float((w * w).sum())
    return float(w.sum()) ** 2 / (w.numel() * square_sum) if square_sum > 0 else 0.0


def _quantile(values: Tensor, q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default);
    sort-based, so unlike torch.quantile it has no input-size limit."""
    ordered = values.double().sort().values
    position = q * (ordered.numel() - 1)
    lower = math.floor(position)
    upper = min(lower + 1, ordered.numel() - 1)
    low_value, high_value = float(ordered[lower]), float(ordered[upper])
    return low_value + (high_value - low_value) * (position - lower)


# --- importance weights ----------------------------------------------------------------------


def is_weights(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, settings: ISConfig
) -> tuple[Tensor, dict[str, float]]:
    """Behaviour weights w ≈ π_old/μ per token, detached, 0 outside the mask
    (docs/algorithms.md#importance-weights).

    Token level: w_t = exp(clamp(log r_t, ±log_ratio_clamp)). Sequence level: every trained
    token of sequence s gets w_s = exp(clamp(Σ_t log r_t, ±log_ratio_clamp)). Then `tis`:
    min(w, cap); `icepop`: w if alpha <= w <= beta, else 0; `none`: 1. With batch_normalize
    the weights are divided by their mean over the units below (skipped if that mean is ~0);
    do it on the whole local batch, not per micro-batch.

    Metrics count *units*: trained tokens (token level) or sequences with at least one trained
    token (sequence level); 0.0 when there are none.
    - is_mean, is_max: mean and max of w after tis/icepop, before batch normalisation;
    - is_ess: (Σw)² / (N Σw²) of those weights (normalisation does not change it);
    - is_raw_ess: the same of the clamped raw ratios, what the weights would be uncorrected;
    - is_frac_capped: fraction of units whose raw ratio is >= cap (tis; else 0);
    - is_raw_frac_over_cap: the same whatever the kind: how much TIS would cap;
    - is_frac_zeroed: fraction of units outside [alpha, beta] (icepop; else 0);
    - is_frac_clamped: fraction of units whose |log ratio| exceeded log_ratio_clamp.
    """

    _check_shapes(mask_BT, old_logp_BT=old_logp_BT, rollout_logp_BT=rollout_logp_BT)
    dtype = _float_dtype(old_logp_BT)
    keep_BT = mask_BT.bool()
    with torch.no_grad():
        log_r_BT = _behaviour_log_ratio(old_logp_BT, rollout_logp_BT, keep_BT, dtype)
        if settings.level == "token":
            unit_log_r, unit_keep = log_r_BT, keep_BT
        else:
            unit_log_r, unit_keep = log_r_BT.sum(dim=-1), keep_BT.any(dim=-1)
        bound = settings.log_ratio_clamp
        raw = torch.exp(unit_log_r.clamp(-bound, bound))
        capped = torch.zeros_like(unit_keep)
        zeroed = torch.zeros_like(unit_keep)
        if settings.kind == "none":
            applied = torch.ones_like(raw)
        elif settings.kind == "tis":
            capped = raw >= settings.cap
            applied = raw.clamp(max=settings.cap)
        else:
            zeroed = (raw < settings.alpha) | (raw > settings.beta)
            applied = torch.where(zeroed, torch.zeros_like(raw), raw)
        applied = _masked(applied, unit_keep)

        kept_applied = applied[unit_keep]
        metrics = {
            "is_mean": _mean(applied, unit_keep),
            "is_max": float(kept_applied.max()) if kept_applied.numel() else 0.0,
            "is_ess": _ess(kept_applied),
            "is_raw_ess": _ess(raw[unit_keep]),
            "is_frac_capped": _frac(capped, unit_keep),
            "is_raw_frac_over_cap": _frac(raw >= settings.cap, unit_keep),
            "is_frac_zeroed": _frac(zeroed, unit_keep),
            "is_frac_clamped": _frac(unit_log_r.abs() > bound, unit_keep),
        }
        if settings.batch_normalize and metrics["is_mean"] > 1e-8:
            applied = applied / metrics["is_mean"]
        w_BT = applied if settings.level == "token" else applied[:, None].expand_as(log_r_BT)
        w_BT = _masked(w_BT, keep_BT).contiguous()
    return w_BT, metrics


# --- rejection -------------------------------------------------------------------------------


def _token_statistic(log_r_BT: Tensor, metric: KLEstimator) -> Tensor:

    if metric == "k1":
        return -log_r_BT
    if metric == "k2":
        return 0.5 * log_r_BT.square()
    return torch.expm1(log_r_BT) - log_r_BT  # k3 = r - 1 - log r, accurate for small log r


def _in_range(stat: Tensor, rule: RejectionRule) -> Tensor:

    # NaN fails every comparison, so a NaN statistic is rejected.
    inside = torch.ones_like(stat, dtype=torch.bool)
    if rule.low is not None:
        inside &= stat >= rule.low
    if rule.high is not None:
        inside &= stat <= rule.high
    return inside


def _rule_keep(log_r_BT: Tensor, keep_BT: Tensor, rule: RejectionRule) -> Tensor:

    stat_BT = _token_statistic(log_r_BT, rule.metric)
    if rule.level == "token":
        return _in_range(stat_BT, rule) & keep_BT
    if rule.reduce == "max":
        seq_stat = torch.where(keep_BT, stat_BT, -math.inf).amax(dim=-1)
    else:
        seq_stat = _masked(stat_BT, keep_BT).sum(dim=-1)
        if rule.reduce == "mean":
            seq_stat = seq_stat / keep_BT.sum(dim=-1).clamp(min=1)
    return _in_range(seq_stat, rule)[:, None] & keep_BT


def rejection_mask(
    old_logp_BT: Tensor,
    rollout_logp_BT: Tensor,
    mask_BT: Tensor,
    rules: Sequence[RejectionRule],
) -> tuple[Tensor, dict[str, float]]:
    """Which trained tokens survive every rule (docs/algorithms.md#rejection-masks): a bool
    [B, T], False outside the mask, so `mask_BT * keep_BT` (or keep_BT itself) is the new
    response mask.

    Statistics are computed in float64 from log r = old_logp - rollout_logp: token rules test
    each token; sequence rules reduce a sequence's trained tokens (sum | mean | max) and keep
    or drop all of them. A NaN statistic is rejected.

    Metrics (fractions of trained tokens, and of sequences with at least one trained token;
    0.0 when there are none): rs_rejected_token_frac and rs_rejected_seq_frac (sequences left
    with no token) for all rules together; rs_rule{i}_{label}_rejected_token_frac and
    rs_rule{i}_{label}_rejected_seq_frac for rule i alone (label as `token_k1`,
    `seq_mean_k3`).
    """

    _check_shapes(mask_BT, old_logp_BT=old_logp_BT, rollout_logp_BT=rollout_logp_BT)
    keep_BT = mask_BT.bool()
    seqs_B = keep_BT.any(dim=-1)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        log_r_BT = _behaviour_log_ratio(old_logp_BT, rollout_logp_BT, keep_BT, torch.float64)
        combined = keep_BT.clone()
        for index, rule in enumerate(rules):
            rule_keep = _rule_keep(log_r_BT, keep_BT, rule)
            combined &= rule_keep
            name = f"rs_rule{index}_{rule.label}"
            metrics[f"{name}_rejected_token_frac"] = _frac(~rule_keep, keep_BT)
            metrics[f"{name}_rejected_seq_frac"] = _frac(~rule_keep.any(dim=-1), seqs_B)
        metrics["rs_rejected_token_frac"] = _frac(~combined, keep_BT)
        metrics["rs_rejected_seq_frac"] = _frac(~combined.any(dim=-1), seqs_B)
    return combined, metrics


# --- policy loss -----------------------------------------------------------------------------


def ppo_loss_terms(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    w_BT: Tensor | None,
    mask_BT: Tensor,
    clip: ClipConfig,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token decoupled PPO loss, 0 outside the mask (docs/algorithms.md#decoupled-ppo):

        rho = exp(clamp(logp - old_logp, ±20)),
        L = -w · min(rho Â, clip(rho, 1 - eps_low, 1 + eps_high) Â),
        and with dual clip, for Â < 0: L = -w · max(min(rho Â, clip(rho) Â), c Â).

    `adv` is [B] (one advantage per sequence, as GRPO gives) or [B, T]; `w_BT` the detached
    behaviour weights from `is_weights` (None: 1). Gradient flows only into `logp_BT`;
    old_logp, adv and w are treated as constants.

    Metrics (fractions and means over the trained tokens of this call; 0.0 if none):
    - pg_clipfrac: tokens whose clipped term is active (their gradient is cut);
    - pg_clipfrac_high: Â > 0 and rho > 1 + eps_high; pg_clipfrac_low: Â < 0 and rho < 1 - eps_low;
    - pg_dual_clipfrac: Â < 0 tokens held at the dual-clip bound (0 when off);
    - pg_approx_kl: mean of rho - 1 - log rho, the k3 estimate of KL(π_old ‖ π_θ);
    - pg_num_tokens: the number of trained tokens, to weight these across micro-batches.
    """

    adv_BT = adv[:, None].expand_as(logp_BT) if adv.dim() == 1 else adv
    _check_shapes(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv=adv_BT, w_BT=w_BT)
    keep = mask_BT.bool()
    logp = _masked(logp_BT, keep)
    old_logp = _masked(old_logp_BT.detach().to(logp.dtype), keep)
    adv_t = _masked(adv_BT.detach().to(logp.dtype), keep)
    w = keep.to(logp.dtype) if w_BT is None else _masked(w_BT.detach().to(logp.dtype), keep)

    log_ratio = (logp - old_logp).clamp(-SAFETY_LOG_RATIO, SAFETY_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv_t * ratio
    loss_clipped = -adv_t * ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    clip_active = loss_clipped > loss_unclipped
    loss = torch.where(clip_active, loss_clipped, loss_unclipped)
    dual_active = torch.zeros_like(keep)
    if clip.dual_clip_c is not None:
        dual_bound = -adv_t * clip.dual_clip_c
        dual_active = (adv_t < 0) & (loss > dual_bound)
        loss = torch.where(dual_active, dual_bound, loss)
    loss_BT = _masked(w * loss, keep)

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _frac(clip_active, keep),
            "pg_clipfrac_high": _frac((adv_t > 0) & (ratio > 1.0 + clip.eps_high), keep),
            "pg_clipfrac_low": _frac((adv_t < 0) & (ratio < 1.0 - clip.eps_low), keep),
            "pg_dual_clipfrac": _frac(dual_active, keep),
            "pg_approx_kl": _mean(torch.expm1(log_ratio) - log_ratio, keep),
            "pg_num_tokens": float(keep.sum()),
        }
    return loss_BT, metrics


def kl_penalty(
    logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, estimator: KLEstimator
) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref), 0 outside the mask; differentiable in logp_BT.

    With x = ref_logp - logp = log(π_ref/π_θ) (Schulman 2020, q = π_θ, p = π_ref):
    k1 = -x, k2 = ½ x², k3 = e^x - 1 - x. For k3, x is clamped to ±20 first, so an extreme
    token gives a finite value with zero gradient rather than an overflow.
    """

    _check_shapes(mask_BT, logp_BT=logp_BT, ref_logp_BT=ref_logp_BT)
    keep = mask_BT.bool()
    logp = _masked(logp_BT, keep)
    x = _masked(ref_logp_BT.detach().to(logp.dtype), keep) - logp
    if estimator == "k1":
        kl = -x
    elif estimator == "k2":
        kl = 0.5 * x.square()
    else:
        x = x.clamp(-SAFETY_LOG_RATIO, SAFETY_LOG_RATIO)
        kl = torch.expm1(x) - x
    return _masked(kl, keep)


def policy_token_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    settings: LossConfig,
    w_BT: Tensor | None = None,
    ref_logp_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """`ppo_loss_terms` plus `kl_coef` times `kl_penalty` (when kl_coef > 0): the per-token
    loss to hand to `aggregate`. Adds metric pg_ref_kl (mean per-token KL to the reference)."""
    loss_BT, metrics = ppo_loss_terms(logp_BT, old_logp_BT, adv, w_BT, mask_BT, settings.clip)
    if settings.kl_coef > 0.0:
        if ref_logp_BT is None:
            raise ValueError("kl_coef > 0 needs ref_logp_BT (the reference policy's logprobs)")
        kl_BT = kl_penalty(logp_BT, ref_logp_BT, mask_BT, settings.kl_estimator)
        loss_BT = loss_BT + settings.kl_coef * kl_BT
        metrics["pg_ref_kl"] = _mean(kl_BT.detach(), mask_BT.bool())
    return loss_BT, metrics


# --- aggregation -----------------------------------------------------------------------------


def loss_denominator(mask_BT: Tensor, mode: Aggregation) -> float:
    """This micro-batch's share of the global denominator: its trained tokens (token-mean) or
    its sequences with at least one trained token (seq-mean-*). Sum over micro-batches and
    data-parallel ranks before calling `aggregate` (module docstring)."""
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be [B, T], got shape {tuple(mask_BT.shape)}")
    keep = mask_BT.bool()
    if mode == "token-mean":
        return float(keep.sum())
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float(keep.any(dim=-1).sum())
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: Aggregation, denominator: float) -> Tensor:
    """This micro-batch's contribution to the step loss, a scalar with gradient:

    - token-mean:          Σ_{s,t} L·m / D
    - seq-mean-token-mean: Σ_s (Σ_t L·m / Σ_t m) / D
    - seq-mean-token-sum:  Σ_{s,t} L·m / D

    where D = `denominator`, the global sum of `loss_denominator` over every micro-batch of
    every data-parallel rank in the step. Summing the contributions (and their gradients) over
    any split of the batch gives exactly the full-batch loss (module docstring).
    """
    _check_shapes(mask_BT, loss_BT=loss_BT)
    if not math.isfinite(denominator) or denominator < 0:
        raise ValueError(
            f"denominator must be a finite count >= 0, got {denominator}; pass the sum of "
            "loss_denominator over all micro-batches and data-parallel ranks"
        )
    scale = 1.0 / max(denominator, 1.0)
    keep = mask_BT.bool()
    masked = _masked(loss_BT, keep)
    if mode in ("token-mean", "seq-mean-token-sum"):
        return masked.sum() * scale
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1).to(masked.dtype)
        return per_seq.sum() * scale
    raise ValueError(f"unknown aggregation {mode!r}")


# --- mismatch metrics ------------------------------------------------------------------------


def mismatch_metrics(
    old_logp_BT: Tensor,
    rollout_logp_BT: Tensor,
    mask_BT: Tensor,
    log_ratio_clamp: float = SAFETY_LOG_RATIO,
) -> dict[str, float]:
    """Train/inference mismatch between π_old (trainer) and μ (engine), every step
    (docs/algorithms.md#mismatch-metrics). In float64 over trained tokens t and over the
    sequences s with at least one trained token (n_s of them in s); log r_t = log π_old - log μ;
    0.0 if empty.

    - kl:           mean_t(-log r_t), k1 estimate of KL(μ ‖ π_old); > 0: the engine was more
                    confident in its samples than the trainer;
    - k3_kl:        mean_t(r_t - 1 - log r_t), the k3 estimate of the same KL (≥ 0, lower
                    variance; the one to watch, docs/algorithms.md#mismatch-metrics);
    - log_ppl_diff: mean_s(-(1/n_s) Σ_t log r_t) = mean_s(log PPL_old(s) - log PPL_μ(s)), with
                    PPL_π(s) = exp(-(1/n_s) Σ_t log π(y_t));
    - ppl_ratio:    mean_s exp(-(1/n_s) Σ_t log r_t) = mean_s PPL_old(s) / PPL_μ(s);
    - chi2_token:   mean_t(r_t²) - 1, the χ² divergence of the token IS weights (their
                    spread; E[r] = 1 on-policy), with log r_t clamped to ±log_ratio_clamp;
    - chi2_seq:     mean_s(R_s²) - 1 with R_s = exp(clamp(Σ_t log r_t, ±log_ratio_clamp)), the
                    same for sequence-level weights (> 10: IS adds noise, prefer rejection);
    - abs_log_ratio_mean, abs_log_ratio_p99, abs_log_ratio_max: mean, 99th percentile (linear
                    interpolation) and max of |log π_old - log μ| over trained tokens
                    (a jump means a kernel, precision or version bug, not learning:
                    docs/algorithms.md#mismatch-metrics).
    """

    _check_shapes(mask_BT, old_logp_BT=old_logp_BT, rollout_logp_BT=rollout_logp_BT)
    keep = mask_BT.bool()
    names = (
        "kl",
        "k3_kl",
        "log_ppl_diff",
        "ppl_ratio",
        "chi2_token",
        "chi2_seq",
        "abs_log_ratio_mean",
        "abs_log_ratio_p99",
        "abs_log_ratio_max",
    )
    if not bool(keep.any()):
        return dict.fromkeys(names, 0.0)
    with torch.no_grad():
        log_r = _behaviour_log_ratio(old_logp_BT, rollout_logp_BT, keep, torch.float64)
        tokens = log_r[keep]
        seqs = keep.any(dim=-1)
        n_s = keep.sum(dim=-1)[seqs].double()
        seq_sum = log_r.sum(dim=-1)[seqs]
        seq_mean = seq_sum / n_s
        token_clamped = tokens.clamp(-log_ratio_clamp, log_ratio_clamp)
        seq_clamped = seq_sum.clamp(-log_ratio_clamp, log_ratio_clamp)
        abs_tokens = tokens.abs()
        values = (
            float((-tokens).mean()),
            float((torch.expm1(tokens) - tokens).mean()),
            float((-seq_mean).mean()),
            float(torch.exp(-seq_mean).mean()),
            float(torch.exp(2.0 * token_clamped).mean() - 1.0),
            float(torch.exp(2.0 * seq_clamped).mean() - 1.0),
            float(abs_tokens.mean()),
            _quantile(abs_tokens, 0.99),
            float(abs_tokens.max()),
        )
    return dict(zip(names, values, strict=True))
