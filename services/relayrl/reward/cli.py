"""`relayrl-reward`: the reward-service: scores items for the pipeline and for any team."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.core.service_cli import service_main
from relayrl.reward.config import RewardConfig


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        prog="relayrl-reward",
        description="the reward-service: scores items for the pipeline and for any team.",
        config_cls=RewardConfig,
        env_prefix="RELAYRL_REWARD",
        serve=None,
        unavailable_reason="the reward-service lands with issue #3",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
