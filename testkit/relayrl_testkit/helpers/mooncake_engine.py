"""Runner of the Mooncake data plane end to end (a real vLLM engine, the relayrl-weightsync
service, a sender in this process), inside the private network namespace that `unshare -n`
started us in (Mooncake listens on every interface):

    unshare -n -- python -m relayrl_testkit.helpers.mooncake_engine MODEL_DIR WORKDIR

Publishes two versions (the second reuses the Mooncake engines both sides keep) and prints one
JSON line: the replicas' versions and live flags, the plan's transport, whether the engine's
checksum after the sync equals its checksum after loading the same export from a file, and the
service's delivered-bytes metric.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors.torch import load_file, save_file

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.inference.client import VllmEngineClient
from relayrl.inference.config import EngineHttpConfig
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
from relayrl.weightsync.sender import WeightSyncSender, export_tensors
from relayrl_testkit.helpers.engines import vllm_cache

BUCKET = 96 * 1024


def worker_rpc(engine: EngineProcess, method: str, payload: dict[str, Any]) -> list[Any]:
    async def call() -> list[Any]:
        client = VllmEngineClient(
            engine.url, http=EngineHttpConfig(control_timeout_s=120), rpc_timeout_s=120
        )
        try:
            return await client.worker_rpc(method, payload)
        finally:
            await client.close()

    return asyncio.run(call())


def main(model_dir: Path, workdir: Path) -> dict[str, Any]:
    config = EngineConfig(
        model=model_dir, max_model_len=512, cache_dir=vllm_cache(workdir), load_dirs=[workdir]
    )
    engine = EngineProcess(config, workdir / "engine").start()
    try:
        service_config = {
            "bucket_size_bytes": BUCKET,
            "engines": {"urls": [engine.url], "load_timeout_s": 120},
            "data_plane": {"transport": "mooncake", "timeout_s": 60},
            "transfer_timeout_s": 60,
        }
        with ServiceProcess("relayrl-weightsync", service_config, workdir / "ws") as service:
            sender = WeightSyncSender(service.target, timeout_s=120)
            original = load_file(model_dir / "model.safetensors")
            for version in (1, 2):
                generator = torch.Generator().manual_seed(version)
                weights = {
                    name: t + 0.3 * t.std() * torch.randn(t.shape, generator=generator)
                    for name, t in original.items()
                }
                result = sender.publish(version, version, weights.items())
                sender.wait_committed(result.transfer_id, 180)
            sender.close()
            with grpc.insecure_channel(service.target) as channel:
                stub = weightsync_pb2_grpc.WeightSyncStub(channel)
                state = stub.GetVersion(pb.GetVersionRequest(), timeout=10)
                plan = stub.GetBucketPlan(
                    pb.GetBucketPlanRequest(transfer_id=result.transfer_id), timeout=10
                )
            url = f"http://127.0.0.1:{service.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                delivered = [
                    line
                    for line in response.read().decode().splitlines()
                    if line.startswith("relayrl_weightsync_delivered_bytes_total")
                ]
        (synced,) = worker_rpc(engine, "relayrl_weight_info", {})
        wire, _ = export_tensors(weights.items(), "none")
        save_file(wire, workdir / "export.safetensors")
        worker_rpc(engine, "relayrl_load_tensors", {"path": str(workdir / "export.safetensors")})
        (from_file,) = worker_rpc(engine, "relayrl_weight_info", {})
        return {
            "committed": state.committed.version,
            "replicas": [[r.version, r.live] for r in state.replicas],
            "transport": pb.TransportType.Name(plan.transport),
            "bit_exact": synced["digest"] == from_file["digest"],
            "delivered": delivered,
        }
    finally:
        engine.stop()


if __name__ == "__main__":
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
