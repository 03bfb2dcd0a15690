"""`relayrl-reward`: the reward-service: scores items for the pipeline and for any team."""

from relayrl.core.service_cli import service_command

main = service_command(
    "relayrl-reward",
    description="the reward-service: scores items for the pipeline and for any team.",
    config="relayrl.reward.config:RewardConfig",
    serve="relayrl.reward.server:serve",
)
