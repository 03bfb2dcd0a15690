"""relayrl-gateway as a real process between a real redis-server and a real vLLM engine:
groups are claimed under the staleness throttle and come back as trajectories with token ids,
masks, log-probs and version spans; an engine killed mid-rollout yields is_infra trajectories,
not a hang and not a reward."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.core.grpc_client import make_channel
from relayrl.core.service_process import ServiceProcess
from relayrl.engine.process import EngineProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer

P = "train"


def gateway_config(
    redis: RedisServer, model_dir: Path, engine_url: str, batch_groups: int = 2, **rollout: object
) -> dict:
    return {
        "tq": {"url": redis.url, "partitions": [P]},
        "tokenizer": str(model_dir),
        "engines": {"urls": [engine_url], "health_interval_s": 0.5, "request_timeout_s": 60},
        "rollout": {"partitions": [P], **rollout},
        "rollout_shape": {"batch_groups": batch_groups, "eta": 0},
    }


def group(uid: str, max_tokens: int = 12, step: int = 0) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid,
        num_samples=2,
        prompt_step=step,
        prompt_token_ids=[1, 77, 88, 99, 2, 1],
        data_source="arith",
        ground_truth="4",
        sampling=common_pb2.SamplingParams(temperature=1.0, max_response_tokens=max_tokens, seed=7),
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def rpc(gateway: ServiceProcess, call: Callable):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        async with make_channel(gateway.target, default_timeout_s=30) as channel:
            return await call(rollout_pb2_grpc.RolloutGatewayStub(channel))

    return asyncio.run(main())


def test_rollouts_follow_the_throttle_and_write_complete_trajectories(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    tq.put_groups(P, [group(f"g{k}") for k in range(4)])
    config = gateway_config(redis_server, model_dir, engine.url)
    with ServiceProcess("relayrl-gateway", config, tmp_path / "gw") as gateway:
        # eta 0, B 2, trainer at step 0: launched < (0 + 1 + 0) * 2 -> two groups, no more.
        wait_until(lambda: tq.counts(P).groups.get("finished", 0) == 2, 60, "two groups")
        time.sleep(1.0)
        counts = tq.counts(P)
        assert counts.num_launched == 2 and counts.groups.get("pending") == 2
        status = rpc(gateway, lambda stub: stub.GetStatus(rollout_pb2.GetStatusRequest()))
        assert status.num_launched == 2 and status.replicas[0].replica_id == "engine-0"
        assert status.replicas[0].state == rollout_pb2.REPLICA_STATE_SERVING
        rpc(
            gateway,
            lambda stub: stub.UpdatePolicyStep(
                rollout_pb2.UpdatePolicyStepRequest(policy_step=1, batch_size=2)
            ),
        )
        wait_until(lambda: tq.counts(P).groups.get("finished", 0) == 4, 60, "all four groups")
        assert gateway.alive()
    for entry in tq.get_groups(P, [f"g{k}" for k in range(4)]):
        assert len(entry.trajectories) == 2
        for trajectory in entry.trajectories:
            n = len(trajectory.response_token_ids)
            assert 1 <= n <= 12
            assert trajectory.response_mask == b"\x01" * n
            assert len(trajectory.rollout_logprobs) == n
            assert all(lp <= 0.0 for lp in trajectory.rollout_logprobs)
            assert list(trajectory.prompt_token_ids) == [1, 77, 88, 99, 2, 1]
            (span,) = trajectory.spans
            assert (span.start, span.end, span.policy_version) == (0, n, 0)
            assert span.generated and span.replica == "engine-0"
            assert trajectory.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
            assert not trajectory.tags.is_infra
    tq.close()


def test_an_engine_killed_mid_rollout_yields_infra_trajectories_not_a_hang(
    redis_server: RedisServer,
    model_dir: Path,
    private_engine: Callable[..., EngineProcess],
    tmp_path: Path,
) -> None:
    doomed = private_engine("doomed")  # killed below
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    tq.put_groups(P, [group(f"k{k}", max_tokens=400) for k in range(2)])
    config = gateway_config(redis_server, model_dir, doomed.url, batch_groups=2)
    try:
        with ServiceProcess("relayrl-gateway", config, tmp_path / "gw") as gateway:
            wait_until(lambda: tq.counts(P).num_launched == 2, 60, "two launched groups")
            doomed.kill()  # SIGKILL to the engine and its helpers, mid-rollout
            wait_until(
                lambda: (
                    tq.counts(P).groups.get("finished", 0) + tq.counts(P).groups.get("scored", 0)
                    == 2
                ),
                60,
                "both groups settled",
            )
            status = rpc(gateway, lambda stub: stub.ListReplicas(rollout_pb2.ListReplicasRequest()))
            assert status.replicas[0].state == rollout_pb2.REPLICA_STATE_UNHEALTHY
            assert gateway.alive()
            # The failure is logged under the rollout's session id.
            assert re.search(r"\[(k\d_\d)\] rollout \1 failed \(infrastructure\)", gateway.log())
    finally:
        doomed.kill()
    trajectories = [t for g in tq.get_groups(P, ["k0", "k1"]) for t in g.trajectories]
    failed = [t for t in trajectories if t.tags.status == common_pb2.TRAJECTORY_STATUS_FAILED]
    assert failed, "a killed engine must leave failed trajectories"
    for trajectory in failed:
        assert trajectory.tags.is_infra
        assert "Engine" in trajectory.error or "replica" in trajectory.error
        assert not trajectory.HasField("reward")  # never a reward, let alone 0
    tq.close()


def test_groups_claimed_by_a_killed_gateway_are_requeued_and_finished_by_another(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    tq.put_groups(P, [group(f"d{k}", max_tokens=400) for k in range(2)])
    # a short lease so the survivor's sweep finds the dead gateway's claims within seconds
    config = gateway_config(redis_server, model_dir, engine.url, lease_s=2.0)
    doomed = ServiceProcess("relayrl-gateway", config, tmp_path / "doomed").start()
    try:
        wait_until(lambda: tq.counts(P).groups.get("running", 0) == 2, 60, "two claimed groups")
        doomed.kill()  # SIGKILL: its claims are never released, only left to expire
    finally:
        doomed.stop()
    assert tq.counts(P).groups.get("running") == 2
    with ServiceProcess("relayrl-gateway", config, tmp_path / "survivor") as survivor:
        wait_until(lambda: tq.counts(P).groups.get("finished", 0) == 2, 120, "both groups")
        assert "returned to pending: d" in survivor.log()
        url = f"http://127.0.0.1:{survivor.metrics_port}/metrics"
        metrics = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'relayrl_gateway_groups_requeued_total{partition="train"} 2.0' in metrics
    for entry in tq.get_groups(P, ["d0", "d1"]):
        assert len(entry.trajectories) == 2
        for trajectory in entry.trajectories:
            assert trajectory.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
        assert entry.group.tags.num_claims == 2  # the doomed gateway's claim, then the survivor's
    tq.close()


def test_control_plane_pauses_resumes_at_a_new_version_and_refuses_bad_requests(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    import urllib.request

    import grpc

    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    config = gateway_config(redis_server, model_dir, engine.url, batch_groups=8)
    with ServiceProcess("relayrl-gateway", config, tmp_path / "gw") as gateway:
        paused = rpc(
            gateway,
            lambda stub: stub.PauseReplicas(
                rollout_pb2.PauseReplicasRequest(mode=rollout_pb2.PAUSE_MODE_KEEP, next_version=5)
            ),
        )
        assert list(paused.paused_replica_ids) == ["engine-0"]
        listed = rpc(gateway, lambda stub: stub.ListReplicas(rollout_pb2.ListReplicasRequest()))
        assert listed.replicas[0].state == rollout_pb2.REPLICA_STATE_PAUSED
        tq.put_groups(P, [group("v5")])  # claimed, but waits: no replica serves
        time.sleep(1.0)
        assert tq.counts(P).groups.get("finished", 0) == 0
        rpc(
            gateway,
            lambda stub: stub.ResumeReplicas(
                rollout_pb2.ResumeReplicasRequest(version=common_pb2.WeightVersion(version=5))
            ),
        )
        wait_until(lambda: tq.counts(P).groups.get("finished", 0) == 1, 60, "the group")
        (entry,) = tq.get_groups(P, ["v5"])
        assert {t.tags.min_policy_version for t in entry.trajectories} == {5}
        assert {t.spans[0].policy_version for t in entry.trajectories} == {5}

        def refused(call: Callable) -> grpc.StatusCode:  # type: ignore[type-arg]
            with pytest.raises(grpc.aio.AioRpcError) as error:
                rpc(gateway, call)
            return error.value.code()

        assert (
            refused(lambda stub: stub.PauseReplicas(rollout_pb2.PauseReplicasRequest()))
            is grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (
            refused(
                lambda stub: stub.DrainReplica(rollout_pb2.DrainReplicaRequest(replica_id="nope"))
            )
            is grpc.StatusCode.NOT_FOUND
        )
        assert (
            refused(
                lambda stub: stub.UpdatePolicyStep(
                    rollout_pb2.UpdatePolicyStepRequest(policy_step=-1)
                )
            )
            is grpc.StatusCode.INVALID_ARGUMENT
        )
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        assert 'relayrl_gateway_rollouts_total{outcome="finished",partition="train"} 2.0' in metrics
        assert 'relayrl_gateway_prefix_cache_resets_total{replica="engine-0"} 1.0' in metrics
        assert "relayrl_gateway_pause_duration_seconds_count 1.0" in metrics
        # Whole-rollout durations: both rollouts counted; the one held by the pause ran > 1 s.
        labels = 'outcome="finished",partition="train"'
        assert f"relayrl_gateway_rollout_duration_seconds_count{{{labels}}} 2.0" in metrics
        under_1s = re.search(
            rf'relayrl_gateway_rollout_duration_seconds_bucket{{le="1.0",{labels}}} (\S+)', metrics
        )
        assert under_1s is not None and float(under_1s.group(1)) <= 1.0
    tq.close()
