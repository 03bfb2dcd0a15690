"""`relayrl-trainer`: the trainer: megatron-core GRPO/PPO on scored groups."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.core.service_cli import service_main
from relayrl.trainer.config import TrainerConfig


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        prog="relayrl-trainer",
        description="the trainer: megatron-core GRPO/PPO on scored groups.",
        config_cls=TrainerConfig,
        env_prefix="RELAYRL_TRAINER",
        serve=None,
        unavailable_reason="the trainer lands with issue #5",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
