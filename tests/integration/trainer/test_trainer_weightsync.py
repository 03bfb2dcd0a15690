"""The trainer publishing through weight-sync into a real vLLM engine: every step's version
is committed on the engine before the next step (publish.wait_for_commit), and the engine's
weights change with it. Rollout and reward are played by `RolloutEmulator`."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_trainer_process import trainer_config, wait_exit
from trainer_tq import RolloutEmulator

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.client import VllmEngineClient
from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

pytestmark = pytest.mark.slow


def engine_state(engine: EngineProcess) -> tuple[str, str]:
    async def main() -> tuple[str, str]:
        client = VllmEngineClient(engine.url)
        try:
            (info,) = await client.worker_rpc("relayrl_weight_info", {})
            return await client.weight_version(), info["digest"]
        finally:
            await client.close()

    return asyncio.run(main())


def test_every_step_is_committed_on_the_engine(redis_server, tq, model_dir, tmp_path) -> None:
    engine = EngineProcess(
        EngineConfig(model=model_dir, max_model_len=512, cache_dir=tmp_path / "cache"),
        tmp_path / "engine",
    ).start()
    try:
        _, initial_digest = engine_state(engine)
        ws_config = {"bucket_size_bytes": 256 * 1024, "engines": {"urls": [engine.url]}}
        with ServiceProcess("relayrl-weightsync", ws_config, tmp_path / "ws") as weightsync:
            config = trainer_config(
                redis_server,
                model_dir,
                tmp_path,
                total_steps=2,
                publish={"type": "weightsync", "target": weightsync.target},
            )
            emulator = RolloutEmulator(tq).start()
            try:
                trainer = ServiceProcess("relayrl-trainer", config, tmp_path / "t")
                trainer.start(timeout_s=120)
                assert wait_exit(trainer, 300) == 0, trainer.log()
            finally:
                emulator.stop()
            with grpc.insecure_channel(weightsync.target) as channel:
                version = weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
                    pb.GetVersionRequest(), timeout=10
                )
        assert version.committed.version == 2
        assert [(r.version, r.live) for r in version.replicas] == [(2, True)]
        label, digest = engine_state(engine)
        assert label == "2" and digest != initial_digest
    finally:
        engine.stop()
