"""The trainer's loss math against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from relayrl.core.config import ConfigError, load_config
from relayrl.trainer.loss_config import ClipConfig, ISConfig, LossConfig, RejectionRule
from relayrl.trainer.losses import (
    aggregate,
    is_weights,
    kl_penalty,
    loss_denominator,
    mismatch_metrics,
    policy_token_loss,
    ppo_loss_terms,
    rejection_mask,
)

LN2 = math.log(2.0)
NAN = math.nan


def t(rows: list[list[float]], requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=requires_grad)


def close(actual: torch.Tensor, expected: list[list[float]] | list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


# --- settings --------------------------------------------------------------------------------


def test_defaults_are_valid() -> None:
    settings = LossConfig()
    assert (settings.clip.eps_low, settings.clip.eps_high) == (0.2, 0.28)
    assert settings.importance_sampling.kind == "none"
    assert settings.rejection == []


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ClipConfig(eps_low=-0.1), "eps_low"),
        (lambda: ClipConfig(eps_low=1.0), "eps_low"),
        (lambda: ClipConfig(dual_clip_c=1.1), r"dual_clip_c \(1.1\) must be .* 1 \+ eps_high"),
        (lambda: ISConfig(kind="is"), "kind"),
        (lambda: ISConfig(kind="icepop", alpha=6.0, beta=5.0), "icepop interval is empty"),
        (lambda: ISConfig(kind="icepop", alpha=1.5, beta=5.0), "must contain 1"),
        (lambda: ISConfig(kind="tis", cap=0.5), "cap"),
        (lambda: ISConfig(log_ratio_clamp=100.0), "log_ratio_clamp"),
        (lambda: RejectionRule(metric="k1", level="sequence", high=1.0), "needs reduce"),
        (lambda: RejectionRule(metric="k1", level="token", reduce="sum", high=1.0), "only applies"),
        (lambda: RejectionRule(metric="k4", level="token", high=1.0), "metric"),
        (lambda: RejectionRule(metric="k3", level="token"), "needs low, high or both"),
        (lambda: RejectionRule(metric="k1", level="token", low=1.0, high=0.0), "nothing is kept"),
        (lambda: RejectionRule(metric="k1", level="token", high=math.inf), "high"),
        (lambda: LossConfig(aggregation="mean"), "aggregation"),
        (lambda: LossConfig(kl_coef=-1.0), "kl_coef"),
        (lambda: LossConfig.model_validate({"clip": {"eps_hi": 0.3}}), "Extra inputs"),
    ],
)
def test_bad_settings_raise_validation_errors(build, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build()


def test_a_bad_loss_section_is_one_config_error_line() -> None:
    environ = {
        "T__IMPORTANCE_SAMPLING__KIND": "icepop",
        "T__IMPORTANCE_SAMPLING__ALPHA": "3",
        "T__IMPORTANCE_SAMPLING__BETA": "2",
    }
    with pytest.raises(ConfigError) as error:
        load_config(LossConfig, None, "T", environ)
    assert "\n" not in str(error.value)
    assert "importance_sampling: icepop interval is empty: alpha (3.0)" in str(error.value)


def test_options_the_mode_ignores_are_warned_about() -> None:
    with pytest.warns(UserWarning, match="alpha ignored"):
        ISConfig(kind="tis", alpha=0.3)
    with pytest.warns(UserWarning, match="cap ignored"):
        ISConfig(kind="icepop", cap=3.0)
    with pytest.warns(UserWarning, match="kl_estimator ignored: kl_coef is 0"):
        LossConfig(kl_estimator="k1")


def test_rule_labels() -> None:
    assert RejectionRule(metric="k1", level="token", high=1).label == "token_k1"
    assert RejectionRule(metric="k3", level="sequence", reduce="mean", high=1).label == (
        "seq_mean_k3"
    )


# --- importance weights ----------------------------------------------------------------------


def test_tis_caps_token_weights() -> None:
    # log r = old - rollout = ln 3, ln 0.5, 0 (the 4th token is padding, its NaN never read)
    old = t([[math.log(3.0), math.log(0.5), 0.0, NAN]])
    rollout = torch.zeros_like(old)
    mask = t([[1, 1, 1, 0]])
    w, metrics = is_weights(old, rollout, mask, ISConfig(kind="tis", cap=2.0))
    # raw 3, 0.5, 1 -> min(., 2) = 2, 0.5, 1
    close(w, [[2.0, 0.5, 1.0, 0.0]])
    assert metrics["is_frac_capped"] == pytest.approx(1 / 3)
    assert metrics["is_frac_zeroed"] == 0.0
    assert metrics["is_mean"] == pytest.approx(3.5 / 3)
    assert metrics["is_max"] == pytest.approx(2.0)
    # ESS = (Σw)² / (N Σw²) = 3.5² / (3 * (4 + 0.25 + 1)) = 12.25 / 15.75
    assert metrics["is_ess"] == pytest.approx(12.25 / 15.75)
    # raw: 4.5² / (3 * (9 + 0.25 + 1)) = 20.25 / 30.75
    assert metrics["is_raw_ess"] == pytest.approx(20.25 / 30.75)


def test_icepop_zeroes_weights_outside_the_interval() -> None:
    # raw weights 3, 0.4, 0.5, 2 with [alpha, beta] = [0.5, 2]: the ends are kept
    old = t([[math.log(3.0), math.log(0.4), math.log(0.5), LN2]])
    w, metrics = is_weights(
        old, torch.zeros_like(old), torch.ones_like(old), ISConfig(kind="icepop", beta=2.0)
    )
    close(w, [[0.0, 0.0, 0.5, 2.0]])
    assert metrics["is_frac_zeroed"] == pytest.approx(0.5)
    assert metrics["is_frac_capped"] == 0.0
    assert metrics["is_raw_frac_over_cap"] == pytest.approx(0.5)  # 3 and 2 reach cap 2


def test_the_fraction_over_the_cap_is_measured_without_correction() -> None:
    old = t([[math.log(3.0), math.log(0.5), 0.0, math.log(2.5)]])
    _, metrics = is_weights(old, torch.zeros_like(old), torch.ones_like(old), ISConfig())
    assert metrics["is_raw_frac_over_cap"] == pytest.approx(0.5)
    assert metrics["is_frac_capped"] == 0.0  # kind none caps nothing


def test_sequence_level_weight_is_exp_of_the_clamped_sum() -> None:
    # row 0: log r = 0.1 + 0.2 (third token padding) = 0.3 -> e^0.3 on both trained tokens
    # row 1: log r = -0.5 + 0.1 - 0.2 = -0.6 -> e^-0.6 on all three
    old = t([[0.1, 0.2, 99.0], [-0.5, 0.1, -0.2]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    w, metrics = is_weights(
        old, torch.zeros_like(old), mask, ISConfig(level="sequence", kind="tis")
    )
    a, b = math.exp(0.3), math.exp(-0.6)
    close(w, [[a, a, 0.0], [b, b, b]])
    # metrics count sequences: ESS over the two sequence weights
    assert metrics["is_ess"] == pytest.approx((a + b) ** 2 / (2 * (a * a + b * b)))


def test_the_safety_clamp_keeps_weights_finite_and_nonzero() -> None:
    # sequence log ratio sum of ±1000: exp would be inf / 0; clamped to ±20
    old = t([[500.0, 500.0], [-500.0, -500.0]])
    settings = ISConfig(level="sequence", kind="tis", cap=1e6)
    w, metrics = is_weights(old, torch.zeros_like(old), torch.ones_like(old), settings)
    close(w, [[1e6, 1e6], [math.exp(-20.0), math.exp(-20.0)]])
    assert metrics["is_frac_clamped"] == 1.0
    assert metrics["is_frac_capped"] == 0.5
    # token level, clamp 5: log r = 7 -> e^5
    w, _ = is_weights(
        t([[7.0]]), t([[0.0]]), t([[1.0]]), ISConfig(kind="tis", cap=1e6, log_ratio_clamp=5.0)
    )
    close(w, [[math.exp(5.0)]])


def test_batch_normalisation_makes_the_mean_weight_one() -> None:
    # weights 2, 0.5, 1 (tis as above) have mean 7/6 -> 12/7, 3/7, 6/7
    old = t([[math.log(3.0), math.log(0.5), 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    settings = ISConfig(kind="tis", batch_normalize=True)
    w, metrics = is_weights(old, torch.zeros_like(old), mask, settings)
    close(w, [[12 / 7, 3 / 7, 6 / 7, 0.0]])
    assert metrics["is_mean"] == pytest.approx(7 / 6)  # reported before normalising


def test_kind_none_gives_ones_but_measures_the_raw_weights() -> None:
    old = t([[math.log(3.0), 0.0]])
    w, metrics = is_weights(old, torch.zeros_like(old), t([[1, 1]]), ISConfig())
    close(w, [[1.0, 1.0]])
    assert metrics["is_ess"] == 1.0
    assert metrics["is_raw_ess"] == pytest.approx(16 / (2 * 10))  # (3 + 1)² / (2 (9 + 1))


def test_weights_are_detached() -> None:
    old = t([[0.3, -0.2]], requires_grad=True)
    rollout = t([[0.1, 0.1]], requires_grad=True)
    logp = t([[0.25, -0.1]], requires_grad=True)
    w, _ = is_weights(old, rollout, t([[1, 1]]), ISConfig(kind="tis"))
    assert not w.requires_grad
    loss, _ = ppo_loss_terms(logp, old, t([1.0]), w, t([[1, 1]]), ClipConfig())
    loss.sum().backward()
    assert logp.grad is not None
    assert old.grad is None and rollout.grad is None


# --- rejection -------------------------------------------------------------------------------

# log r per trained token: row 0: 0.5, -1, 0.1; row 1: 0.2, 2 (then padding, garbage 1e9)
# k1 = -log r:          row 0: -0.5, 1, -0.1;            row 1: -0.2, -2
# k2 = (log r)²/2:      row 0: 0.125, 0.5, 0.005;        row 1: 0.02, 2
# k3 = e^x - 1 - x:     row 0: 0.148721, 0.367879, 0.005171; row 1: 0.021403, 4.389056
RS_OLD = [[0.5, -1.0, 0.1], [0.2, 2.0, 1e9]]
RS_MASK = [[1, 1, 1], [1, 1, 0]]


def reject(*rules: RejectionRule) -> tuple[torch.Tensor, dict[str, float]]:
    old = t(RS_OLD)
    return rejection_mask(old, torch.zeros_like(old), t(RS_MASK), rules)


def test_token_rule_drops_single_tokens() -> None:
    keep, metrics = reject(RejectionRule(metric="k1", level="token", low=-1.5, high=0.5))
    # k1 = 1 (row 0) is above 0.5, k1 = -2 (row 1) below -1.5
    assert keep.tolist() == [[True, False, True], [True, False, False]]
    assert metrics["rs_rule0_token_k1_rejected_token_frac"] == pytest.approx(2 / 5)
    assert metrics["rs_rule0_token_k1_rejected_seq_frac"] == 0.0
    assert metrics["rs_rejected_token_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    ("rule", "kept_rows"),
    [
        # sums of k2: 0.63 and 2.02
        (RejectionRule(metric="k2", level="sequence", reduce="sum", high=1.0), [True, False]),
        # means of k3: 0.521771/3 = 0.17392 and 4.410459/2 = 2.20523
        (RejectionRule(metric="k3", level="sequence", reduce="mean", high=0.2), [True, False]),
        # means of k3 again, a lower bound only
        (RejectionRule(metric="k3", level="sequence", reduce="mean", low=0.2), [False, True]),
        # max of k1: 1 and -0.2
        (RejectionRule(metric="k1", level="sequence", reduce="max", high=0.9), [False, True]),
        # sum of k1: -0.5 + 1 - 0.1 = 0.4 and -2.2
        (RejectionRule(metric="k1", level="sequence", reduce="sum", low=-1.0), [True, False]),
    ],
)
def test_sequence_rules_drop_whole_sequences(rule: RejectionRule, kept_rows: list[bool]) -> None:
    keep, metrics = reject(rule)
    expected = [[kept_rows[0]] * 3, [kept_rows[1], kept_rows[1], False]]
    assert keep.tolist() == expected
    assert metrics["rs_rejected_seq_frac"] == 0.5


def test_rules_are_anded() -> None:
    token_k1 = RejectionRule(metric="k1", level="token", low=-1.5, high=0.5)
    seq_max_k1 = RejectionRule(metric="k1", level="sequence", reduce="max", high=0.9)
    keep, metrics = reject(token_k1, seq_max_k1)
    # seq_max_k1 drops row 0, token_k1 drops token (1, 1): only (1, 0) is left
    assert keep.tolist() == [[False, False, False], [True, False, False]]
    assert metrics["rs_rejected_token_frac"] == pytest.approx(4 / 5)
    assert metrics["rs_rejected_seq_frac"] == pytest.approx(1 / 2)
    assert metrics["rs_rule1_seq_max_k1_rejected_token_frac"] == pytest.approx(3 / 5)
    # the caller applies it to the response mask
    assert (t(RS_MASK) * keep).tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_a_nan_statistic_is_rejected_and_no_rules_keep_everything() -> None:
    old = t([[NAN, 0.0]])
    keep, _ = rejection_mask(
        old, torch.zeros_like(old), t([[1, 1]]), [RejectionRule(metric="k1", level="token", high=9)]
    )
    assert keep.tolist() == [[False, True]]
    keep, metrics = rejection_mask(old, torch.zeros_like(old), t([[0, 1]]), [])
    assert keep.tolist() == [[False, True]]
    assert metrics == {"rs_rejected_token_frac": 0.0, "rs_rejected_seq_frac": 0.0}


# --- PPO -------------------------------------------------------------------------------------


def test_asymmetric_clipping_on_both_sides() -> None:
    # old_logp = 0, so rho = exp(logp); eps_low 0.2, eps_high 0.28: clip to [0.8, 1.28]
    rho = [1.5, 1.5, 0.5, 0.5, 1.1]
    adv = [1.0, -1.0, 1.0, -1.0, 2.0]
    logp = t([[math.log(r) for r in rho]], requires_grad=True)
    loss, metrics = ppo_loss_terms(
        logp, torch.zeros_like(logp), t([adv]), None, torch.ones_like(logp), ClipConfig()
    )
    # max(-A rho, -A clip(rho)):
    # t0: max(-1.5, -1.28) = -1.28 (clipped above, A > 0)   gradient 0
    # t1: max(1.5, 1.28) = 1.5                               d/dlogp = -A rho = 1.5
    # t2: max(-0.5, -0.8) = -0.5                             -0.5
    # t3: max(0.5, 0.8) = 0.8 (clipped below, A < 0)         0
    # t4: max(-2.2, -2.2) = -2.2 (inside the range)          -2.2
    close(loss, [[-1.28, 1.5, -0.5, 0.8, -2.2]])
    loss.sum().backward()
    assert logp.grad is not None
    close(logp.grad, [[0.0, 1.5, -0.5, 0.0, -2.2]])
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_high"] == pytest.approx(1 / 5)
    assert metrics["pg_clipfrac_low"] == pytest.approx(1 / 5)
    assert metrics["pg_dual_clipfrac"] == 0.0
    assert metrics["pg_num_tokens"] == 5.0
    # mean of rho - 1 - ln rho
    expected_kl = sum(r - 1 - math.log(r) for r in rho) / 5
    assert metrics["pg_approx_kl"] == pytest.approx(expected_kl)


def test_weights_scale_the_loss_and_sequence_advantages_broadcast() -> None:
    # rho = 1 everywhere: L = -w A; A per sequence: +2, -1
    logp = torch.zeros(2, 2, dtype=torch.float64)
    w = t([[1.0, 0.5], [2.0, 0.0]])
    loss, _ = ppo_loss_terms(logp, logp, t([2.0, -1.0]), w, t([[1, 1], [1, 0]]), ClipConfig())
    close(loss, [[-2.0, -1.0], [2.0, 0.0]])


def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    # A = -1: rho 4 -> max(4, 1.28) = 4, capped at c |A| = 3; rho 2 -> 2 (under the cap)
    # A = +1: rho 4 -> -1.28 (the dual clip does not apply)
    logp = t([[math.log(4.0), LN2, math.log(4.0)]], requires_grad=True)
    loss, metrics = ppo_loss_terms(
        logp,
        torch.zeros_like(logp),
        t([[-1.0, -1.0, 1.0]]),
        None,
        torch.ones_like(logp),
        ClipConfig(dual_clip_c=3.0),
    )
    close(loss, [[3.0, 2.0, -1.28]])
    loss.sum().backward()
    assert logp.grad is not None
    close(logp.grad, [[0.0, 2.0, 0.0]])  # -A rho = 2 where unclipped
    assert metrics["pg_dual_clipfrac"] == pytest.approx(1 / 3)


def test_garbage_at_padding_reaches_neither_loss_nor_gradient() -> None:
    logp = t([[0.1, NAN], [math.inf, -math.inf]], requires_grad=True)
    old = t([[0.0, math.inf], [NAN, 0.0]])
    mask = t([[1, 0], [0, 0]])
    loss, _ = ppo_loss_terms(logp, old, t([[1.0, NAN], [NAN, NAN]]), None, mask, ClipConfig())
    total = aggregate(loss, mask, "token-mean", loss_denominator(mask, "token-mean"))
    total.backward()
    assert logp.grad is not None
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0 and logp.grad[1].eq(0).all()


def test_shapes_are_checked() -> None:
    with pytest.raises(
        ValueError, match=r"old_logp_BT has shape \(2, 3\) but mask_BT has \(2, 2\)"
    ):
        is_weights(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 2), ISConfig())


# --- reference KL ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "values", "grads"),
    [
        # x = ref - logp = ln(0.25/0.5) = -ln 2, ln(0.5/0.25) = ln 2
        ("k1", [LN2, -LN2], [1.0, 1.0]),  # -x; d/dlogp = 1
        ("k2", [LN2**2 / 2, LN2**2 / 2], [LN2, -LN2]),  # x²/2; d/dlogp = -x
        # e^x - 1 - x: 0.5 - 1 + ln 2 = 0.19315 and 2 - 1 - ln 2 = 0.30685; d/dlogp = 1 - e^x
        ("k3", [LN2 - 0.5, 1 - LN2], [0.5, -1.0]),
    ],
)
def test_kl_penalty_estimators(estimator: str, values: list[float], grads: list[float]) -> None:
    logp = t([[math.log(0.5), math.log(0.25), 0.0]], requires_grad=True)
    ref = t([[math.log(0.25), math.log(0.5), NAN]])
    kl = kl_penalty(logp, ref, t([[1, 1, 0]]), estimator)
    close(kl, [[*values, 0.0]])
    kl.sum().backward()
    assert logp.grad is not None
    close(logp.grad, [[*grads, 0.0]])


def test_k3_penalty_is_finite_for_an_extreme_token() -> None:
    logp = t([[-1000.0]], requires_grad=True)
    kl = kl_penalty(logp, t([[0.0]]), t([[1]]), "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()


def test_policy_token_loss_adds_the_weighted_penalty() -> None:
    logp = t([[math.log(0.5)]])
    ref = t([[math.log(0.25)]])
    settings = LossConfig(kl_coef=0.1, kl_estimator="k1")
    # rho = 1, A = 1: pg = -1; k1 = ln 2; total = -1 + 0.1 ln 2
    loss, metrics = policy_token_loss(logp, logp, t([1.0]), t([[1]]), settings, ref_logp_BT=ref)
    close(loss, [[-1.0 + 0.1 * LN2]])
    assert metrics["pg_ref_kl"] == pytest.approx(LN2)
    with pytest.raises(ValueError, match="needs ref_logp_BT"):
        policy_token_loss(logp, logp, t([1.0]), t([[1]]), settings)


# --- aggregation -----------------------------------------------------------------------------

AGG_LOSS = [[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]]
AGG_MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "denominator", "expected"),
    [
        ("token-mean", 4.0, 10 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-mean", 2.0, (2 + 4) / 2),  # row means 2 and 4; the empty row is no seq
        ("seq-mean-token-sum", 2.0, (6 + 4) / 2),  # row sums 6 and 4
    ],
)
def test_aggregation_modes(mode: str, denominator: float, expected: float) -> None:
    mask = t(AGG_MASK)
    assert loss_denominator(mask, mode) == denominator
    assert aggregate(t(AGG_LOSS), mask, mode, denominator).item() == pytest.approx(expected)


def test_a_zero_denominator_gives_zero_and_a_negative_one_is_refused() -> None:
    mask = torch.zeros(1, 2)
    assert aggregate(torch.ones(1, 2), mask, "token-mean", 0.0).item() == 0.0
    with pytest.raises(ValueError, match="sum of loss_denominator"):
        aggregate(torch.ones(1, 2), mask, "token-mean", -1.0)


def _invariance_batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    batch, length = 8, 7
    lengths = torch.tensor([7, 1, 5, 2, 6, 3, 1, 4])  # very uneven, so local means disagree
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    old = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    logp = old + torch.randn(batch, length, generator=generator, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(batch, length, generator=generator, dtype=torch.float64) * 0.2
    adv = torch.randn(batch, generator=generator, dtype=torch.float64)
    return logp, old, rollout, adv, mask


def _step_loss(splits: list[list[tuple[int, int]]], mode: str) -> tuple[float, torch.Tensor]:
    """Total loss and d/dlogp when the batch is split over ranks (outer list) and micro-batches
    (row ranges); the rank gradients are summed as an all-reduce SUM would."""
    logp_full, old, rollout, adv, mask = _invariance_batch()
    logp = logp_full.clone().requires_grad_(True)
    settings = LossConfig(
        aggregation=mode,
        importance_sampling=ISConfig(kind="tis", cap=1.5),
    )
    # every rank knows every micro-batch's share (in the trainer: a sum, then an all-reduce)
    denominator = sum(loss_denominator(mask[a:b], mode) for rank in splits for a, b in rank)
    total = 0.0
    for rank in splits:
        for a, b in rank:
            w, _ = is_weights(old[a:b], rollout[a:b], mask[a:b], settings.importance_sampling)
            loss_BT, _ = policy_token_loss(logp[a:b], old[a:b], adv[a:b], mask[a:b], settings, w)
            contribution = aggregate(loss_BT, mask[a:b], settings.aggregation, denominator)
            contribution.backward()
            total += contribution.item()
    assert logp.grad is not None
    return total, logp.grad


SPLITS = {
    "1 micro-batch": [[(0, 8)]],
    "2 micro-batches": [[(0, 4), (4, 8)]],
    "4 micro-batches": [[(0, 2), (2, 4), (4, 6), (6, 8)]],
    "2 ranks, uneven micro-batches": [[(0, 1), (1, 4)], [(4, 7), (7, 8)]],
}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_any_split_gives_the_full_batch_loss_and_gradient(mode: str) -> None:
    full_loss, full_grad = _step_loss(SPLITS["1 micro-batch"], mode)
    for name, split in SPLITS.items():
        loss, grad = _step_loss(split, mode)
        assert loss == pytest.approx(full_loss, rel=1e-12, abs=1e-12), name
        torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-12, msg=name)


def test_a_per_micro_batch_mean_depends_on_the_split() -> None:
    """The bug of docs/algorithms.md#global-denominator: each micro-batch divides by its own
    token count and the results are averaged, so a token in a short micro-batch weighs more
    than one in a long one."""
    logp, old, _, adv, mask = _invariance_batch()
    settings = LossConfig()
    quarters = [(0, 2), (2, 4), (4, 6), (6, 8)]

    def contributions(ranges: list[tuple[int, int]], denominators: list[float]) -> list[float]:
        result = []
        for (a, b), denominator in zip(ranges, denominators, strict=True):
            loss_BT, _ = policy_token_loss(logp[a:b], old[a:b], adv[a:b], mask[a:b], settings)
            result.append(aggregate(loss_BT, mask[a:b], "token-mean", denominator).item())
        return result

    full = contributions([(0, 8)], [mask.sum().item()])[0]
    local = [mask[a:b].sum().item() for a, b in quarters]  # 8, 7, 9, 5 tokens
    naive = sum(contributions(quarters, local)) / len(quarters)
    global_denominator = [sum(local)] * len(quarters)
    assert sum(contributions(quarters, global_denominator)) == pytest.approx(full, rel=1e-12)
    assert naive != pytest.approx(full, rel=1e-2)


# --- mismatch metrics ------------------------------------------------------------------------


def test_mismatch_metrics_by_hand() -> None:
    # log r: row 0: ln 2, 0 (then padding); row 1: -ln 2
    old = t([[LN2, 0.0, NAN], [-LN2, 5.0, 5.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    metrics = mismatch_metrics(old, torch.zeros_like(old), mask)
    expected = {
        "kl": 0.0,  # mean(-ln 2, 0, ln 2)
        # (2 - 1 - ln 2) + 0 + (0.5 - 1 + ln 2) = 0.5, over 3 tokens
        "k3_kl": 0.5 / 3,
        # -seq means: -ln2/2 and ln 2 -> mean ln2/4
        "log_ppl_diff": LN2 / 4,
        # exp(-ln2/2) = 0.70711 and exp(ln 2) = 2 -> mean 1.35355
        "ppl_ratio": (2**-0.5 + 2.0) / 2,
        "chi2_token": (4 + 1 + 0.25) / 3 - 1,  # r² = 4, 1, 0.25
        "chi2_seq": (4 + 0.25) / 2 - 1,  # sequence ratios 2 and 0.5
        "abs_log_ratio_mean": 2 * LN2 / 3,
        "abs_log_ratio_p99": LN2,  # sorted 0, ln2, ln2: position 1.98 is between two ln 2
        "abs_log_ratio_max": LN2,
    }
    assert metrics == pytest.approx(expected)


def test_p99_interpolates_and_chi2_seq_is_clamped() -> None:
    # |log r| sorted 0, 0.1, 0.2, 0.3, 0.4: position 0.99 * 4 = 3.96 -> 0.3 + 0.96 * 0.1
    old = t([[0.0, 0.1, -0.2, 0.3, -0.4]])
    metrics = mismatch_metrics(old, torch.zeros_like(old), torch.ones_like(old))
    assert metrics["abs_log_ratio_p99"] == pytest.approx(0.396)
    # a 30-token sequence off by 30 nats per token: Σ = 900, clamped to 20 -> e^40 - 1
    old = torch.full((1, 30), 30.0, dtype=torch.float64)
    metrics = mismatch_metrics(old, torch.zeros_like(old), torch.ones_like(old))
    assert metrics["chi2_seq"] == pytest.approx(math.exp(40.0) - 1)


def test_mismatch_metrics_of_an_empty_mask_are_zero() -> None:
    metrics = mismatch_metrics(torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    assert set(metrics.values()) == {0.0}
