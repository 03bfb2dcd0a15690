"""The trainer publishing through weight-sync into a real vLLM engine: every step's version
is committed on the engine before the next step (publish.wait_for_commit), and the engine's
weights change with it. Rollout and reward are played by `RolloutEmulator`."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import Iterator

import grpc
import pytest

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.process import EngineProcess
from relayrl.inference.client import VllmEngineClient
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
from relayrl_testkit.helpers.trainer import RolloutEmulator, steps_logged, trainer_config, wait_exit

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


def test_every_step_is_committed_and_a_resumed_trainer_puts_its_weights_back(
    redis_server, tq, model_dir, engine, tmp_path
) -> None:
    _, initial_digest = engine_state(engine)
    with publishing_to(redis_server, model_dir, tmp_path, [engine], total_steps=3) as (
        weightsync,
        config,
    ):
        train_to_the_end(tq, config, tmp_path / "t")
        assert committed(weightsync).committed.version == 3
        label, digest = engine_state(engine)
        assert label == "3" and digest != initial_digest
        # The trainer crashed before its step-3 checkpoint became durable: the engine
        # holds version 3, whose weights the resumed trainer no longer has.
        shutil.rmtree(tmp_path / "ckpt" / f"step-{3:08d}")
        resumed = train_to_the_end(tq, config, tmp_path / "t2")
        version = committed(weightsync)
        assert "republished version 2" in resumed.log()
        assert weightsync.log().count("version 2 committed") == 2
    assert version.committed.version == 3
    assert [(r.version, r.live) for r in version.replicas] == [(3, True)]
    label, resumed_digest = engine_state(engine)
    assert label == "3" and resumed_digest != initial_digest


@contextlib.contextmanager
def publishing_to(
    redis_server, model_dir, tmp_path, engines, *, bucket_size_bytes: int = 256 * 1024, **over
) -> Iterator[tuple[ServiceProcess, dict]]:
    """A relayrl-weightsync in front of `engines`, and a trainer config (`over` its fields)
    that publishes to it."""
    ws_config = {
        "bucket_size_bytes": bucket_size_bytes,
        "engines": {"urls": [e.url for e in engines]},
    }
    with ServiceProcess("relayrl-weightsync", ws_config, tmp_path / "ws") as weightsync:
        publish = {"type": "weightsync", "target": weightsync.target}
        yield weightsync, trainer_config(redis_server, model_dir, tmp_path, publish=publish, **over)


def train_to_the_end(tq, config: dict, workdir) -> ServiceProcess:
    """The trainer of `config`, run to its last step against a rollout emulator."""
    emulator = RolloutEmulator(tq).start()
    try:
        trainer = ServiceProcess("relayrl-trainer", config, workdir)
        trainer.start(timeout_s=120)
        assert wait_exit(trainer, 300) == 0, trainer.log()
    finally:
        emulator.stop()
    return trainer


def committed(weightsync: ServiceProcess) -> pb.GetVersionResponse:
    with grpc.insecure_channel(weightsync.target) as channel:
        return weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
            pb.GetVersionRequest(), timeout=10
        )


def test_tp2_trainer_ranks_send_to_two_replicas(
    redis_server, tq, model_dir, engine, second_engine, tmp_path
) -> None:
    engines = [engine, second_engine]
    with publishing_to(
        redis_server,
        model_dir,
        tmp_path,
        engines,
        bucket_size_bytes=128 * 1024,
        total_steps=1,
        model={"hf_dir": str(model_dir), "tensor_parallel": 2},
    ) as (weightsync, config):
        train_to_the_end(tq, config, tmp_path / "t")
        with grpc.insecure_channel(weightsync.target) as channel:
            version = weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
                pb.GetVersionRequest(), timeout=10
            )
        # both ranks pushed their share of the buckets, one stream each
        assert weightsync.log().count("WeightSync/PushBuckets code=OK") == 2
    record = steps_logged(tmp_path / "steps.jsonl")[0]
    assert record.publish_sent_bytes is not None and record.publish_bytes is not None
    assert 0 < record.publish_sent_bytes < record.publish_bytes  # rank 0's share
    assert version.committed.version == 1
    assert sorted((r.replica_id, r.version, r.live) for r in version.replicas) == [
        ("engine-0", 1, True),
        ("engine-1", 1, True),
    ]
    states = [engine_state(e) for e in engines]
    assert states[0] == states[1] and states[0][0] == "1"  # same label, same weights


def test_a_research_lag_holds_the_engine_exactly_that_many_versions_back(
    redis_server, tq, model_dir, engine, tmp_path
) -> None:
    """research.policy_lag 2 over 5 steps: the engine gets versions 1, 2, 3 (each two steps
    late, under its own number), then the last trained version, 5, when training ends."""
    with publishing_to(
        redis_server, model_dir, tmp_path, [engine], total_steps=5, research={"policy_lag": 2}
    ) as (weightsync, config):
        train_to_the_end(tq, config, tmp_path / "t")
        log = weightsync.log()
        assert committed(weightsync).committed.version == 5
    commits = [int(x.split()[1]) for x in re.findall(r"version \d+ committed", log)]
    assert commits == [1, 2, 3, 5]
    published = [(r.publish_bytes or 0) > 0 for r in steps_logged(tmp_path / "steps.jsonl")]
    assert published == [False, False, True, True, True]  # steps 0 and 1 sent nothing
    assert engine_state(engine)[0] == "5"
