"""`relayrl audit` calls a consumed group lost only when the trainer would have trained it: its
rules are the trainer's own verdict (`judge_group`) plus the staleness bound. Pure logic: groups
as protos."""

from __future__ import annotations

import pytest

from relayrl.trainer.replay import judge_group
from relayrl.up.audit import StepRules
from relayrl_testkit.helpers.trainer import judged_group as group


@pytest.mark.parametrize(
    ("rewards", "dapo", "verdict"),
    [
        ([1.0, 0.0, 1.0, 0.0], True, "keep"),
        ([1.0, 1.0, 1.0, 1.0], True, "no_signal"),
        ([1.0, 1.0, 1.0, 1.0], False, "keep"),
        # one valid member of four: nothing to compare, with the filter on or off
        ([1.0, None, None, None], False, "no_signal"),
        ([1.0, None, None, None], True, "no_signal"),
        ([None, None, None, None], False, "no_valid"),
        ([1.0], False, "keep"),
        ([1.0, None, 0.0, None], True, "keep"),
    ],
)
def test_the_audit_rejects_exactly_what_the_trainer_does_not_keep(
    rewards: list[float | None], dapo: bool, verdict: str
) -> None:
    g = group(rewards)
    assert judge_group(g, use_dapo_filter=dapo) == verdict
    rules = StepRules(staleness_threshold=1, dapo_filter=dapo)
    assert rules.rejected(g, step=0) is (verdict != "keep")


def test_a_group_past_the_staleness_bound_is_rejected_whatever_its_rewards() -> None:
    rules = StepRules(staleness_threshold=2, dapo_filter=False)
    assert not rules.rejected(group([1.0, 0.0], prompt_step=3), step=4)
    assert rules.rejected(group([1.0, 0.0], prompt_step=2), step=4)
