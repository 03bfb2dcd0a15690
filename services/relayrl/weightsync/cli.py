"""`relayrl-weightsync`: weight-sync: streams each new policy version into every engine."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.core.service_cli import service_main
from relayrl.weightsync.config import WeightSyncConfig


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        prog="relayrl-weightsync",
        description="weight-sync: streams each new policy version into every engine.",
        config_cls=WeightSyncConfig,
        env_prefix="RELAYRL_WEIGHTSYNC",
        serve=None,
        unavailable_reason="the weight-sync service lands with issue #6",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
