"""GetBucketPlan's `wait_for_final_s`: a publisher waits for its commit in one held call
instead of polling. The engine is the emulator with a 3 s weight load (time scale 1), so the
transfer is loading, not final, for long enough to see each answer."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file

from relayrl.core.service_process import ServiceProcess
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
from relayrl.weightsync.sender import WeightSyncSender
from relayrl_testkit.emulator_launcher import start_emulator

LOAD_S = 3.0


def test_a_held_plan_call_answers_at_the_commit_or_its_bound(model_dir: Path, tmp_path: Path):
    emulator = start_emulator(tmp_path / "engine", seed=0, time_scale=1.0, sync_time_s=LOAD_S)
    config = {
        "engines": {"urls": [emulator.url], "load_timeout_s": 60},
        "transfer_timeout_s": 60,
    }
    try:
        with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as weightsync:
            sender = WeightSyncSender(weightsync.target, timeout_s=60)
            channel = grpc.insecure_channel(weightsync.target)
            stub = weightsync_pb2_grpc.WeightSyncStub(channel)
            try:
                result = sender.publish(1, 1, load_file(model_dir / "model.safetensors").items())

                def plan(wait_s: float) -> pb.BucketPlan:
                    request = pb.GetBucketPlanRequest(
                        transfer_id=result.transfer_id, wait_for_final_s=wait_s
                    )
                    return stub.GetBucketPlan(request, timeout=wait_s + 30)

                # The emulator's load takes LOAD_S: a call at once, and one bounded far below
                # it, answer while the version is still loading.
                assert plan(0.0).state != pb.TRANSFER_STATE_COMMITTED
                assert plan(0.2).state != pb.TRANSFER_STATE_COMMITTED
                # A call bounded far above it answers with the outcome.
                assert plan(60.0).state == pb.TRANSFER_STATE_COMMITTED
                sender.wait_committed(result.transfer_id, 60)  # final already: returns

                with pytest.raises(grpc.RpcError) as refused:
                    plan(-1.0)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "wait_for_final_s must be in [0, 600]" in refused.value.details()
                with pytest.raises(grpc.RpcError) as unknown:
                    stub.GetBucketPlan(
                        pb.GetBucketPlanRequest(transfer_id="nope", wait_for_final_s=5), timeout=30
                    )
                assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
            finally:
                channel.close()
                sender.close()
    finally:
        emulator.stop()
