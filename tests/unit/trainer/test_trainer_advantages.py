"""Group advantages and the DAPO filter, against values computed by hand."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from relayrl.trainer.advantages import (
    AdvantageConfig,
    GroupRewards,
    dapo_filter,
    group_advantages,
    has_signal,
)

GRPO = AdvantageConfig()
GRPO_NO_STD = AdvantageConfig(normalize_std=False)
RLOO = AdvantageConfig(estimator="rloo")


def advantages_of(group: GroupRewards, settings: AdvantageConfig) -> tuple[float, ...]:
    (result,) = group_advantages([group], settings)
    assert result.uid == group.uid
    return result.advantages


def test_grpo_divides_by_the_sample_std() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, deviations ±0.5, sample var = 4 * 0.25 / 3 = 1/3,
    # std = 0.57735; A = ±0.5 / (0.57735 + 1e-6) = ±0.866024
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert advantages_of(GroupRewards("g", [1, 0, 0, 1]), GRPO) == pytest.approx(
        (expected, -expected, -expected, expected), rel=1e-12
    )


def test_grpo_without_std_only_centres() -> None:
    # mean of 1, 0, 0.5 is 0.5
    assert advantages_of(GroupRewards("g", [1, 0, 0.5]), GRPO_NO_STD) == pytest.approx(
        (0.5, -0.5, 0.0)
    )


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    # A_0 = 1 - (0 + 0.5)/2 = 0.75; A_1 = 0 - (1 + 0.5)/2 = -0.75; A_2 = 0.5 - (1 + 0)/2 = 0
    assert advantages_of(GroupRewards("g", [1, 0, 0.5]), RLOO) == pytest.approx((0.75, -0.75, 0.0))


def test_infra_members_are_out_of_the_baseline_and_not_trained() -> None:
    # valid rewards 1, 0 (the infra members' 0 and NaN are never read): mean 0.5,
    # sample std sqrt(0.5) = 0.70711 -> A = ±0.5/0.70711 = ±0.70711
    group = GroupRewards("g", [1.0, 0.0, 0.0, math.nan], is_infra=[False, False, True, True])
    (result,) = group_advantages([group], GRPO)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert result.advantages == pytest.approx((expected, -expected, 0.0, 0.0))
    assert result.trainable == (True, True, False, False)
    # had the infra 0 counted, the mean would have been 1/3 and A_0 = 2/3 (no std)
    assert advantages_of(group, GRPO_NO_STD) == pytest.approx((0.5, -0.5, 0.0, 0.0))


@pytest.mark.parametrize("settings", [GRPO, GRPO_NO_STD, RLOO])
def test_groups_without_comparison_get_exact_zeros(settings: AdvantageConfig) -> None:
    # 0.1 * 3 has float mean 0.10000000000000002: a naive std is ~1e-17, and ~1e-11 after
    # dividing by (std + eps); equal rewards must give exactly 0
    assert advantages_of(GroupRewards("equal", [0.1, 0.1, 0.1]), settings) == (0.0, 0.0, 0.0)
    single = GroupRewards("one", [0.7, 0.0], is_infra=[False, True])
    assert advantages_of(single, settings) == (0.0, 0.0)


def test_group_rewards_are_checked() -> None:
    with pytest.raises(ValueError, match="no members"):
        GroupRewards("g", [])
    with pytest.raises(ValueError, match="2 rewards but 3 is_infra"):
        GroupRewards("g", [1, 0], is_infra=[False, False, True])
    with pytest.raises(ValueError, match="mark it is_infra"):
        GroupRewards("g", [1, math.nan])


def test_dapo_filter_sorts_groups_and_counts_refill_credit() -> None:
    signal = GroupRewards("signal", [1, 0, 1])
    all_infra = GroupRewards("all-infra", [0, 0], is_infra=[True, True])
    one_valid = GroupRewards("one-valid", [1, 0, 0], is_infra=[False, True, True])
    zero_std = GroupRewards("zero-std", [1, 1, 1])
    # valid rewards 1, 1 have std 0; the infra member's 0 would have given std > 0
    mixed = GroupRewards("mixed", [1, 1, 0], is_infra=[False, False, True])
    assert has_signal(GroupRewards("mixed-if-infra-counted", [1, 1, 0]))

    result = dapo_filter([signal, all_infra, one_valid, zero_std, mixed])

    assert [g.uid for g in result.kept] == ["signal"]
    assert [g.uid for g in result.filtered] == ["one-valid", "zero-std", "mixed"]
    assert [g.uid for g in result.failed] == ["all-infra"]
    # 2 * 3 filtered + 1 failed
    assert result.refill_credit == 7


def test_dapo_filter_of_nothing() -> None:
    result = dapo_filter([])
    assert (result.kept, result.filtered, result.failed, result.refill_credit) == ((), (), (), 0)


def test_bad_settings_fail_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match="estimator"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValidationError, match="eps"):
        AdvantageConfig(eps=0.0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AdvantageConfig.model_validate({"normalise_std": False})


def test_options_rloo_ignores_are_warned_about() -> None:
    with pytest.warns(UserWarning, match="normalize_std ignored"):
        AdvantageConfig(estimator="rloo", normalize_std=False)
