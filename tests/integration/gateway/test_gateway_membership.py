"""Replica membership with real processes: a gated relayrl-gateway, a relayrl-weightsync with
a state folder, and the engine emulator (vLLM's HTTP subset; it receives versions over gRPC
for real and remembers which transfer it holds, as the worker extension does). A replica is
routed to only once weight-sync vouches for its weights -- at start, after a version, after
weight-sync restarts, and after the engine restarts with its initial weights."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from relayrl.core.ports import free_port
from relayrl.core.service_process import ServiceProcess
from relayrl.inference.client import VllmEngineClient
from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
from relayrl.tq.server import RedisServer
from relayrl.weightsync.sender import WeightSyncSender

pytestmark = pytest.mark.slow
SERVING, LOADING = rollout_pb2.REPLICA_STATE_SERVING, rollout_pb2.REPLICA_STATE_LOADING


class Emulator:
    """The engine emulator on a fixed port, so that a restart comes back at the same URL."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    def start(self) -> Emulator:
        ready = self.workdir / f"ready-{time.monotonic_ns()}.json"
        argv = [sys.executable, "-m", "relayrl_testkit.emulator", "--port", str(self.port),
                "--ready-file", str(ready), "--sync-time-s", "0"]  # fmt: skip
        with (self.workdir / "emulator.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        until(ready.exists, "the emulator to start", 30)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(15)

    def holds(self) -> Any:
        async def ping() -> Any:
            client = VllmEngineClient(self.url)
            try:
                return (await client.worker_rpc("relayrl_ping", {}))[0]["holds"]
            finally:
                await client.close()

        return asyncio.run(ping())


def until(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def replica(gateway: ServiceProcess) -> rollout_pb2.Replica:
    with grpc.insecure_channel(gateway.target) as channel:
        stub = rollout_pb2_grpc.RolloutGatewayStub(channel)
        (found,) = stub.ListReplicas(rollout_pb2.ListReplicasRequest(), timeout=10).replicas
    return found


def committed(weightsync: ServiceProcess) -> pb.GetVersionResponse:
    with grpc.insecure_channel(weightsync.target) as channel:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        return stub.GetVersion(pb.GetVersionRequest(), timeout=10)


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[Emulator]:
    engine = Emulator(tmp_path / "engine", free_port()).start()
    try:
        yield engine
    finally:
        engine.kill()


def test_a_replica_is_routed_only_once_weightsync_vouches_for_its_weights(
    redis_server: RedisServer, model_dir: Path, emulator: Emulator, tmp_path: Path
) -> None:
    gateway_port, weightsync_port = free_port(), free_port()
    gateway_config = {
        "grpc": {"host": "127.0.0.1", "port": gateway_port},
        "tq": {"url": redis_server.url},
        "tokenizer": str(model_dir),
        "engines": {"urls": [emulator.url], "health_interval_s": 0.2, "unhealthy_after": 1,
                    "register_interval_s": 0.2},
        "agent_http": {"enabled": False},
        "logging": {"json": True},
        "weightsync": {"target": f"127.0.0.1:{weightsync_port}", "default_timeout_s": 5},
    }  # fmt: skip
    weightsync_config = {
        "grpc": {"host": "127.0.0.1", "port": weightsync_port},
        "bucket_size_bytes": 64 * 1024,
        "engines": {"retry_backoff_s": 0.2, "registration_ttl_s": 3},
        "gateway": {"target": f"127.0.0.1:{gateway_port}", "default_timeout_s": 5},
        "state_dir": str(tmp_path / "state"),
    }
    with ServiceProcess("relayrl-gateway", gateway_config, tmp_path / "gw") as gateway:
        # no weight-sync yet: healthy, but nobody has vouched for its weights
        time.sleep(1.0)
        assert replica(gateway).state == LOADING
        weightsync = ServiceProcess("relayrl-weightsync", weightsync_config, tmp_path / "ws")
        weightsync.start()
        try:
            # nothing committed: its initial weights are version 0
            until(lambda: replica(gateway).state == SERVING, "engine-0 to serve at version 0")
            assert replica(gateway).weight_version.version == 0

            tensors = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(300)}
            sender = WeightSyncSender(weightsync.target, timeout_s=60)
            result = sender.publish(1, 1, tensors.items())
            sender.wait_committed(result.transfer_id, 60)
            sender.close()
            # the gateway learns the new version before weight-sync resumes the replica
            until(
                lambda: (
                    (found := replica(gateway)).weight_version.version == 1
                    and found.state == SERVING
                ),
                "version 1 routed",
            )
            assert emulator.holds() == result.transfer_id

            # weight-sync dies and comes back: the committed version is read back, and the
            # replica (which holds it) keeps serving without a reload
            weightsync.kill()
            weightsync = ServiceProcess("relayrl-weightsync", weightsync_config, tmp_path / "ws2")
            weightsync.start()
            version = committed(weightsync)
            assert version.committed.version == 1
            until(lambda: committed(weightsync).replicas, "the gateway to register engine-0")
            time.sleep(1.0)
            assert replica(gateway).state == SERVING and emulator.holds() == result.transfer_id

            # the engine dies and comes back with its initial weights: out of routing until
            # weight-sync has loaded the committed version into it
            emulator.kill()
            until(lambda: replica(gateway).state != SERVING, "engine-0 to leave routing")
            emulator.start()  # a new process: it holds its initial weights until loaded
            until(
                lambda: (
                    replica(gateway).state == SERVING and emulator.holds() == result.transfer_id
                ),
                "engine-0 to be loaded and routed again",
            )
            assert replica(gateway).weight_version.version == 1
            log = weightsync.log()
            assert "late joiner engine-0 reached version 1" in log
        finally:
            weightsync.stop()
    log_lines = (tmp_path / "gw" / "relayrl-gateway.log").read_text().splitlines()
    records = [json.loads(x) for x in log_lines if x.startswith("{")]
    transitions = [r["message"] for r in records if r["message"].startswith("replica engine-0:")]
    # every way into routing went through LOADING, none straight from unhealthy to serving
    assert not any("unhealthy -> serving" in t for t in transitions), transitions
