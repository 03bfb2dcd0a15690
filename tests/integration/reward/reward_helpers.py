"""relayrl-reward as a real process for tests (a ServiceProcess with a gRPC stub), with this
folder on PYTHONPATH so the service can import the test plug-ins by dotted path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc

from relayrl.core.grpc_client import make_channel
from relayrl.core.service_process import ServiceProcess
from relayrl.proto.reward.v1 import reward_pb2_grpc

PLUGINS = Path(__file__).parent


class RewardProcess(ServiceProcess):
    def __init__(self, workdir: Path, config: dict[str, Any], env: dict[str, str] | None = None):
        pythonpath = os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])
        super().__init__(
            "relayrl-reward", config, workdir, env={"PYTHONPATH": pythonpath, **(env or {})}
        )

    def stub(
        self, token: str | None = None
    ) -> tuple[grpc.aio.Channel, reward_pb2_grpc.RewardServiceStub]:
        channel = make_channel(self.target, default_timeout_s=30.0, bearer_token=token)
        return channel, reward_pb2_grpc.RewardServiceStub(channel)
