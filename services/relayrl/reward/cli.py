"""`relayrl-reward`: the reward-service: scores items for the pipeline and for any team."""

from relayrl.core.service_cli import service_command
from relayrl.reward.config import RewardConfig

main = service_command(
    "relayrl-reward",
    description="the reward-service: scores items for the pipeline and for any team.",
    config_cls=RewardConfig,
    serve=None,
    unavailable_reason="the reward-service lands with issue #3",
)
