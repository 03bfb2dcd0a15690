"""`relayrl-trainer`: the trainer: megatron-core GRPO/PPO on scored groups."""

from relayrl.core.service_cli import service_command

main = service_command(
    "relayrl-trainer",
    description="the trainer: megatron-core GRPO/PPO on scored groups.",
    config="relayrl.trainer.config:TrainerConfig",
    serve=None,
    unavailable_reason="the trainer lands with issue #5",
)
