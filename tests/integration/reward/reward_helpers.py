"""Running relayrl-reward as a real process for tests: config in a file, ports from the
ready file, stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from relayrl.core.grpc_client import make_channel
from relayrl.proto.reward.v1 import reward_pb2_grpc

BIN = Path(sys.executable).parent
PLUGINS = Path(__file__).parent


class RewardProcess:
    def __init__(self, workdir: Path, config: dict[str, Any], env: dict[str, str] | None = None):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "reward.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.ready_file = workdir / "ready.json"
        self.log_path = workdir / "reward.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port: int | None = None

    def start(self, timeout_s: float = 60.0) -> RewardProcess:
        self.ready_file.unlink(missing_ok=True)
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                str(BIN / "relayrl-reward"),
                "--config",
                str(self.config_path),
                "--ready-file",
                str(self.ready_file),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"relayrl-reward exited {self.process.returncode}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"relayrl-reward not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)
        ready = json.loads(self.ready_file.read_text())
        self.port, self.metrics_port = ready["grpc_port"], ready["metrics_port"]
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stub(
        self, token: str | None = None
    ) -> tuple[grpc.aio.Channel, reward_pb2_grpc.RewardServiceStub]:
        channel = make_channel(self.target, default_timeout_s=30.0, bearer_token=token)
        return channel, reward_pb2_grpc.RewardServiceStub(channel)

    def terminate(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout_s)
        self._log.close()
        return code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        if hasattr(self, "_log"):
            self._log.close()
