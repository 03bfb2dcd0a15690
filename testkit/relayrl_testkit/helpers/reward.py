"""relayrl-reward as a real process for tests (a ServiceProcess with a gRPC stub). The test
plug-ins it loads by dotted path live in `relayrl_testkit.helpers.reward_plugins`, which the
service imports as it would a team's installed scorer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from relayrl.core.grpc_client import make_channel
from relayrl.core.service_process import ServiceProcess
from relayrl.proto.reward.v1 import reward_pb2_grpc


class RewardProcess(ServiceProcess):
    def __init__(
        self,
        workdir: Path,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        argv: Sequence[str] = (),
    ):
        super().__init__("relayrl-reward", config, workdir, env=env, argv=argv)

    def start(self, timeout_s: float = 60.0) -> RewardProcess:
        super().start(timeout_s)
        return self

    def stub(
        self, token: str | None = None
    ) -> tuple[grpc.aio.Channel, reward_pb2_grpc.RewardServiceStub]:
        channel = make_channel(self.target, default_timeout_s=30.0, bearer_token=token)
        return channel, reward_pb2_grpc.RewardServiceStub(channel)
