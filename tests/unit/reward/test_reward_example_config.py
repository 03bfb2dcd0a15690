"""The annotated example config in deploy/config stays valid."""

from __future__ import annotations

from pathlib import Path

from relayrl.core.config import load_config
from relayrl.reward.config import RewardConfig

EXAMPLE = Path(__file__).parents[3] / "deploy" / "config" / "reward.example.yaml"


def test_the_example_reward_config_loads() -> None:
    config = load_config(RewardConfig, EXAMPLE, "RELAYRL_REWARD", {})
    assert config.managers["judge"].type == "rate_limited"
    assert config.tq_scorer.enabled
    assert config.tenant("someone").managers == ["rules"]
