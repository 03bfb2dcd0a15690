"""weight-sync end to end on real processes: the relayrl-weightsync service, real vLLM engines
(the tiny model) with relayrl's worker extension as receivers, and a sender in this process
standing in for a trainer rank (it publishes HF-named tensors exactly as the trainer's export
yields them).

Buckets are small (96 KiB) so that the tiny model's tensors are both smaller and larger than a
bucket and the plan has many buckets."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.process import EngineProcess
from relayrl.inference.client import GenerateRequest, SamplingOptions, VllmEngineClient
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
from relayrl.weightsync.sender import PublishError, WeightSyncSender, export_tensors
from relayrl_testkit.emulator_launcher import start_emulator
from relayrl_testkit.helpers.engines import engine_call, engine_digest, load_file_into
from relayrl_testkit.helpers.mooncake import mooncake_unavailable

pytestmark = pytest.mark.slow

PROMPT = (3, 17, 42, 99, 7, 250)
GREEDY = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
BUCKET = 96 * 1024


@pytest.fixture
def weightsync(engine: EngineProcess, tmp_path: Path) -> Iterator[ServiceProcess]:
    config = {
        "bucket_size_bytes": BUCKET,
        "chunk_size_bytes": 32 * 1024,
        "engines": {"urls": [engine.url], "load_timeout_s": 120},
        "transfer_timeout_s": 60,
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
        yield service


def perturbed(model_dir: Path, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The original weights, moved: stands in for a trainer step."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + scale * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in load_file(model_dir / "model.safetensors").items()
    }


def generate(engine: EngineProcess) -> list[int]:
    async def scenario(client: VllmEngineClient) -> list[int]:
        request = GenerateRequest(f"t-{uuid.uuid4().hex[:8]}", PROMPT, GREEDY)
        return list((await client.generate(request)).token_ids)

    return engine_call(engine, scenario)


def transformers_greedy(model_dir: Path, weights: dict[str, torch.Tensor]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    return out[0, len(PROMPT) :].tolist()


def version_of(service: ServiceProcess) -> pb.GetVersionResponse:
    with grpc.insecure_channel(service.target) as channel:
        return weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
            pb.GetVersionRequest(), timeout=10
        )


def test_a_version_reaches_the_engine_bit_for_bit_and_generates_like_transformers(
    engine: EngineProcess, weightsync: ServiceProcess, model_dir: Path, tmp_path: Path
) -> None:
    weights = perturbed(model_dir, 0.5, seed=1)
    sender = WeightSyncSender(weightsync.target, timeout_s=120)
    result = sender.publish(1, 1, weights.items())
    sender.wait_committed(result.transfer_id, 180)
    assert result.bytes_total > 3 * BUCKET and result.num_buckets_sent > 3
    committed = version_of(weightsync)
    assert committed.committed.version == 1
    assert [(r.version, r.live) for r in committed.replicas] == [(1, True)]

    async def label(client: VllmEngineClient) -> str:
        return await client.weight_version()

    assert engine_call(engine, label) == "1"
    synced = engine_digest(engine)
    # The same bf16 export written to a file and loaded by the engine's file path: the
    # engine's own checksum over its parameters must not tell the two apart.
    wire, _ = export_tensors(weights.items(), "none")
    save_file(wire, tmp_path / "export.safetensors")
    load_file_into(engine, tmp_path / "export.safetensors")
    assert engine_digest(engine) == synced
    bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    assert generate(engine) == transformers_greedy(model_dir, bf16)
    sender.close()


def test_delta_versions_reach_the_engine_bit_for_bit_in_a_fraction_of_the_bytes(
    engine: EngineProcess, weightsync: ServiceProcess, model_dir: Path, tmp_path: Path
) -> None:
    def exported_digest(weights: dict[str, torch.Tensor], name: str) -> str:
        """The engine's checksum after loading the full bf16 export from a file."""
        wire, _ = export_tensors(weights.items(), "none")
        save_file(wire, tmp_path / f"{name}.safetensors")
        load_file_into(engine, tmp_path / f"{name}.safetensors")
        return engine_digest(engine)

    def publish(sender: WeightSyncSender, version: int, weights: dict[str, torch.Tensor]):
        result = sender.publish(version, version, weights.items())
        sender.wait_committed(result.transfer_id, 180)
        return result, engine_digest(engine)

    generator = torch.Generator().manual_seed(7)
    first = perturbed(model_dir, 0.5, seed=1)
    # a step at an RL learning rate: about 1 % of the weights move by a bf16 unit or more
    sparse = {
        name: t + (torch.rand(t.shape, generator=generator) < 0.01) * 0.05 * t.abs().max()
        for name, t in first.items()
    }
    sender = WeightSyncSender(weightsync.target, timeout_s=120, delta=True)
    full, _ = publish(sender, 1, first)
    assert full.bytes_sent == full.bytes_total  # nothing to make a delta of yet
    small, synced = publish(sender, 2, sparse)
    assert 0 < small.bytes_sent < 0.2 * small.bytes_total, (small.bytes_sent, small.bytes_total)
    assert synced == exported_digest(sparse, "sparse")
    # a dense change: every bucket's delta would be larger, so each goes in full
    dense, synced = publish(sender, 3, perturbed(model_dir, 0.5, seed=3))
    assert dense.bytes_sent == dense.bytes_total
    assert synced == exported_digest(perturbed(model_dir, 0.5, seed=3), "dense")
    sender.close()
    # a restarted trainer has no base: its first version goes in full, the next as deltas
    restarted = WeightSyncSender(weightsync.target, timeout_s=120, delta=True)
    again, _ = publish(restarted, 4, sparse)
    assert again.bytes_sent == again.bytes_total
    back, synced = publish(restarted, 5, first)
    assert back.bytes_sent < 0.2 * back.bytes_total and synced == exported_digest(first, "first")
    restarted.close()


def test_fp8_is_within_the_e4m3_bound_and_generates_close_to_bf16(
    engine: EngineProcess, weightsync: ServiceProcess, model_dir: Path
) -> None:
    from relayrl.dataplane.quant import dequantize_fp8, quantize_fp8

    weights = perturbed(model_dir, 0.5, seed=2)
    for mode in ("per_tensor", "block_128"):
        t = weights["model.layers.0.mlp.down_proj.weight"]
        q, scale = quantize_fp8(t, mode)
        error = (dequantize_fp8(q, scale, mode, torch.float32) - t).abs()
        assert float((error / t.abs().clamp_min(1e-3)).median()) < 2**-4
    bf16_version = version_of(weightsync).committed.version + 1
    sender = WeightSyncSender(weightsync.target, timeout_s=120)
    sender.wait_committed(sender.publish(bf16_version, 0, weights.items()).transfer_id, 180)
    reference = generate(engine)
    fp8 = WeightSyncSender(weightsync.target, timeout_s=120, quantization="fp8_block_128")
    result = fp8.publish(bf16_version + 1, 0, weights.items())
    fp8.wait_committed(result.transfer_id, 180)
    tokens = generate(engine)
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    assert same >= 6, (tokens, reference)  # greedy decoding stays close for the first tokens
    wire_fp8, _ = export_tensors(weights.items(), "fp8_block_128")
    fp8_bytes = sum(t.numel() * t.element_size() for t in wire_fp8.values())
    bf16_bytes = sum(t.numel() * 2 for t in weights.values())
    assert fp8_bytes < 0.75 * bf16_bytes  # the tiny model's embeddings stay bf16
    sender.close()
    fp8.close()


def test_a_corrupted_bucket_and_a_disagreeing_sender_fail_fast(
    weightsync: ServiceProcess, model_dir: Path
) -> None:
    weights = perturbed(model_dir, 0.1, seed=3)
    _, metas = export_tensors(weights.items(), "none")
    with grpc.insecure_channel(weightsync.target) as channel:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        version = stub.GetVersion(pb.GetVersionRequest(), timeout=10).committed.version + 10
        plan = stub.Publish(pb.PublishRequest(version=version, tensors=metas), timeout=10).plan
        # another rank exporting a different set of tensors for the same version
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            stub.Publish(pb.PublishRequest(version=version, tensors=metas[:-1]), timeout=10)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "manifest differs" in raised.value.details()
        assert time.monotonic() - start < 5
        size = plan.buckets[0].size_bytes
        data = bytes(size)
        wrong = hashlib.sha256(b"not the bucket").hexdigest()
        chunk = pb.BucketChunk(
            transfer_id=plan.transfer_id, bucket_index=0, data=data, last=True,
            bucket_sha256=wrong,
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as raised:
            stub.PushBuckets(iter([chunk]), timeout=10)
        assert raised.value.code() == grpc.StatusCode.DATA_LOSS
        assert "checksum mismatch" in raised.value.details()
        short = pb.BucketChunk(
            transfer_id=plan.transfer_id, bucket_index=0, data=b"x", last=True,
            bucket_sha256=hashlib.sha256(b"x").hexdigest(),
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as raised:
            stub.PushBuckets(iter([short]), timeout=10)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"the plan says {size}" in raised.value.details()


def test_a_late_joiner_pulls_the_committed_version(
    engine: EngineProcess,
    weightsync: ServiceProcess,
    model_dir: Path,
    second_engine: EngineProcess,
) -> None:
    weights = perturbed(model_dir, 0.3, seed=4)
    sender = WeightSyncSender(weightsync.target, timeout_s=120)
    version = version_of(weightsync).committed.version + 1
    sender.wait_committed(sender.publish(version, 0, weights.items()).transfer_id, 180)
    expected = generate(engine)
    late = second_engine  # holds its initial weights: they are put back after every test
    try:
        with grpc.insecure_channel(weightsync.target) as channel:
            reply = weightsync_pb2_grpc.WeightSyncStub(channel).RegisterEngine(
                pb.RegisterEngineRequest(replica_id="late", url=late.url, current_version=0),
                timeout=10,
            )
        assert reply.needs_pull and reply.committed.version == version
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            replicas = {r.replica_id: r for r in version_of(weightsync).replicas}
            if replicas["late"].version == version:
                break
            time.sleep(0.2)
        assert replicas["late"].version == version and replicas["late"].live
        assert generate(late) == expected
        assert engine_digest(late) == engine_digest(engine)
    finally:
        sender.close()


def test_publishing_to_an_unreachable_service_is_a_clear_error(model_dir: Path) -> None:
    sender = WeightSyncSender("127.0.0.1:1", timeout_s=2)
    with pytest.raises(PublishError, match="export: Publish of version 1"):
        sender.publish(1, 1, {"w": torch.zeros(2, 2)}.items())
    sender.close()
    assert common_pb2.QUANTIZATION_FP8_BLOCK_128


def test_a_dead_replica_is_dropped_and_the_others_commit(
    engine: EngineProcess, model_dir: Path, tmp_path: Path
) -> None:
    # The replica that dies is killed before the switch reaches it, so what it ran does not
    # matter once weight-sync has registered it: the engine emulator (vLLM's HTTP subset)
    # starts in a second where a vLLM replica takes half a minute.
    doomed = start_emulator(tmp_path / "doomed", seed=0, time_scale=0.01)
    config = {
        "bucket_size_bytes": BUCKET,
        "engines": {"urls": [engine.url, doomed.url], "load_timeout_s": 30, "attempts": 2},
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
        doomed.process.kill()  # the receiver dies before the switch reaches it
        doomed.process.wait(30)
        weights = perturbed(model_dir, 0.2, seed=5)
        sender = WeightSyncSender(service.target, timeout_s=120)
        result = sender.publish(1, 1, weights.items())
        sender.wait_committed(result.transfer_id, 180)
        replicas = {r.replica_id: r for r in version_of(service).replicas}
        assert replicas["engine-0"].version == 1 and replicas["engine-0"].live
        assert not replicas["engine-1"].live and replicas["engine-1"].version == 0
        assert "load" in service.log()  # the failure names its boundary
        sender.close()
    doomed.stop()


def data_plane_config(urls: list[str], transport: str, attempts: int = 2) -> dict[str, object]:
    return {
        "bucket_size_bytes": BUCKET,
        "engines": {"urls": urls, "load_timeout_s": 120, "attempts": attempts},
        "data_plane": {"transport": transport, "timeout_s": 120},
        "transfer_timeout_s": 60,
    }


def test_the_torch_distributed_data_plane_loads_the_engine_bit_for_bit(
    engine: EngineProcess, model_dir: Path, tmp_path: Path
) -> None:
    config = data_plane_config([engine.url], "torch_distributed")
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
        weights = perturbed(model_dir, 0.4, seed=6)
        sender = WeightSyncSender(service.target, timeout_s=120)
        result = sender.publish(1, 1, weights.items())
        sender.wait_committed(result.transfer_id, 180)
        assert [(r.version, r.live) for r in version_of(service).replicas] == [(1, True)]
        synced = engine_digest(engine)
        wire, _ = export_tensors(weights.items(), "none")
        save_file(wire, tmp_path / "export.safetensors")
        load_file_into(engine, tmp_path / "export.safetensors")
        assert engine_digest(engine) == synced
        with grpc.insecure_channel(service.target) as channel:
            plan = weightsync_pb2_grpc.WeightSyncStub(channel).GetBucketPlan(
                pb.GetBucketPlanRequest(transfer_id=result.transfer_id), timeout=10
            )
        assert plan.transport == pb.TRANSPORT_TYPE_TORCH_DISTRIBUTED
        url = f"http://127.0.0.1:{service.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            metrics = response.read().decode()
        assert 'relayrl_weightsync_delivered_bytes_total{transport="torch_distributed"}' in metrics
        sender.close()


def test_a_replica_killed_mid_broadcast_is_dropped_and_the_other_loads_the_whole_version(
    engine: EngineProcess,
    model_dir: Path,
    private_engine: Callable[..., EngineProcess],
    tmp_path: Path,
) -> None:
    from relayrl.dataplane.receiver import FAULT_EXIT_AFTER_BUCKET

    doomed = private_engine(
        "doomed",
        max_model_len=512,
        env={FAULT_EXIT_AFTER_BUCKET: "3"},  # its worker dies after the 4th bucket
    )
    try:
        config = data_plane_config([engine.url, doomed.url], "torch_distributed")
        with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
            weights = perturbed(model_dir, 0.25, seed=7)
            sender = WeightSyncSender(service.target, timeout_s=120)
            start = time.monotonic()
            result = sender.publish(1, 1, weights.items())
            sender.wait_committed(result.transfer_id, 300)
            # The death fails the broadcast at once, not at the data plane's 120 s deadline.
            assert time.monotonic() - start < 90
            replicas = {r.replica_id: r for r in version_of(service).replicas}
            assert replicas["engine-0"].version == 1 and replicas["engine-0"].live
            assert not replicas["engine-1"].live and replicas["engine-1"].version == 0
            assert "attempt 1/2" in service.log()
            sender.close()
        # The survivor holds the whole new version, not a mix of the failed attempt and it.
        wire, _ = export_tensors(weights.items(), "none")
        synced = engine_digest(engine)
        save_file(wire, tmp_path / "export.safetensors")
        load_file_into(engine, tmp_path / "export.safetensors")
        assert engine_digest(engine) == synced
    finally:
        doomed.stop()


def test_the_mooncake_data_plane_loads_the_engine_bit_for_bit(
    model_dir: Path, tmp_path: Path
) -> None:
    """In a private network namespace: Mooncake listens on every interface."""
    if reason := mooncake_unavailable():
        pytest.skip(reason)
    stderr_path = tmp_path / "runner.stderr"
    with stderr_path.open("w") as stderr:
        done = subprocess.run(
            ["unshare", "-n", "--", sys.executable, "-m", "relayrl_testkit.helpers.mooncake_engine",
             str(model_dir), str(tmp_path)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=600, check=False,
        )  # fmt: skip
    assert done.returncode == 0, stderr_path.read_text()[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["committed"] == 2 and report["replicas"] == [[2, True]]
    assert report["transport"] == "TRANSPORT_TYPE_MOONCAKE"
    assert report["bit_exact"], report
    assert any('transport="mooncake"' in line for line in report["delivered"]), report


def test_the_shm_data_plane_loads_the_engine_bit_for_bit_and_a_party_elsewhere_uses_grpc(
    engine: EngineProcess, model_dir: Path, tmp_path: Path
) -> None:
    """On the service's host the sender writes each bucket into shared memory and the worker
    reads it there; a sender and a worker that do not find the service's host token (another
    host) push and pull the bytes instead, and the engine ends up with the same weights."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    config = {
        **data_plane_config([engine.url], "shm"),
        "data_plane": {"transport": "shm", "shm_dir": str(shm_dir), "timeout_s": 120},
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
        (root,) = shm_dir.iterdir()
        assert root.stat().st_mode & 0o777 == 0o700
        sender = WeightSyncSender(service.target, timeout_s=120)

        def publish(version: int, seed: int) -> tuple[dict[str, torch.Tensor], str]:
            weights = perturbed(model_dir, 0.4, seed=seed)
            result = sender.publish(version, version, weights.items())
            sender.wait_committed(result.transfer_id, 180)
            assert result.bytes_sent == result.bytes_total
            assert [(r.version, r.live) for r in version_of(service).replicas] == [(version, True)]
            return weights, engine_digest(engine)

        def transferred(transport: str) -> float:
            url = f"http://127.0.0.1:{service.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                for line in response.read().decode().splitlines():
                    name = f'relayrl_weightsync_transferred_bytes_total{{transport="{transport}"}}'
                    if line.startswith(name):
                        return float(line.rsplit(" ", 1)[1])
            return 0.0

        def exported_digest(weights: dict[str, torch.Tensor]) -> str:
            wire, _ = export_tensors(weights.items(), "none")
            save_file(wire, tmp_path / "export.safetensors")
            load_file_into(engine, tmp_path / "export.safetensors")
            return engine_digest(engine)

        weights, synced = publish(1, seed=8)
        buckets = sorted((root / "slot-0").glob("bucket-*.bin"))
        assert len(buckets) > 3 and all(p.stat().st_mode & 0o777 == 0o600 for p in buckets)
        assert transferred("shm") == sum(p.stat().st_size for p in buckets)
        assert transferred("grpc") == 0
        assert exported_digest(weights) == synced

        host = root / "HOST"
        token = host.read_text()
        host.write_text("another host")  # neither the sender nor the worker find the token
        try:
            weights, synced = publish(2, seed=9)
        finally:
            host.write_text(token)
        assert not list((root / "slot-1").glob("bucket-*.bin"))
        assert transferred("grpc") > 0
        assert exported_digest(weights) == synced

        weights, synced = publish(3, seed=10)  # slot-0 again: version 1 was dropped
        assert transferred("shm") == 2 * sum(p.stat().st_size for p in buckets)
        assert exported_digest(weights) == synced
        sender.close()
    assert not list(shm_dir.iterdir())  # the service took its folder with it
