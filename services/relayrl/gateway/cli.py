"""`relayrl-gateway`: the rollout-gateway: prompt groups in, trajectories out, on vLLM engines."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.core.service_cli import service_main
from relayrl.gateway.config import GatewayConfig


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        prog="relayrl-gateway",
        description="the rollout-gateway: prompt groups in, trajectories out, on vLLM engines.",
        config_cls=GatewayConfig,
        env_prefix="RELAYRL_GATEWAY",
        serve=None,
        unavailable_reason="the rollout-gateway lands with issue #4",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
