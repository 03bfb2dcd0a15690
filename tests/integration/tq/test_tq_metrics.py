"""The TransferQueue's Prometheus collector against a real redis-server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from redis.backoff import NoBackoff
from redis.retry import Retry

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TrajectoryPut, TransferQueue
from relayrl.tq.metrics import TQCollector
from relayrl.tq.server import RedisServer


def test_counts_launched_and_staleness_are_exported(tq: TransferQueue) -> None:
    groups = [
        common_pb2.PromptGroup(uid=f"g{i}", num_samples=1, prompt_step=i, prompt_token_ids=[1])
        for i in range(20)
    ]
    tq.put_groups("train", groups)
    claim = tq.claim_groups("train", max_groups=2, claimer="t", lease_s=60).claimed[0]
    traj = common_pb2.Trajectory(uid=claim.group.uid, index=0, response_token_ids=[5])
    traj.response_mask = b"\x01"
    tq.put_trajectories("train", [TrajectoryPut(traj, claim.claim_id)])
    registry = CollectorRegistry()
    registry.register(TQCollector(tq, "trainer", ["train"], current_step=lambda: 19))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("relayrl_trainer_tq_up_bool") == 1
    assert value("relayrl_trainer_tq_groups", partition="train", status="pending") == 18
    assert value("relayrl_trainer_tq_groups", partition="train", status="finished") == 1
    assert value("relayrl_trainer_tq_trajectories", partition="train", status="finished") == 1
    assert value("relayrl_trainer_tq_launched_groups", partition="train") == 2
    # At step 19, g0 (finished) and g1 (running) have staleness 20 and 19: past the label cap.
    stale = "relayrl_trainer_tq_stale_groups"
    assert value(stale, partition="train", status="finished", staleness="16+") == 1
    assert value(stale, partition="train", status="running", staleness="16+") == 1
    pending = {
        s.labels["staleness"]: s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == stale and s.labels["status"] == "pending"
    }
    # g2..g19 are pending with staleness 18..1: g2 and g3 share the capped label.
    assert pending["1"] == 1 and pending["16"] == 1 and pending["16+"] == 2
    assert sum(pending.values()) == 18
    assert b"relayrl_trainer_tq_groups" in generate_latest(registry)


def test_an_unreachable_redis_reads_as_down_not_as_a_failed_scrape(tmp_path) -> None:
    server = RedisServer(tmp_path / "r")
    server.start()
    tq = TransferQueue(server.client(socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)))
    tq.create_partition("train")
    registry = CollectorRegistry()
    registry.register(TQCollector(tq, "gateway", ["train"]))
    server.kill()
    assert registry.get_sample_value("relayrl_gateway_tq_up_bool") == 0
    assert b"relayrl_gateway_tq_up_bool 0.0" in generate_latest(registry)
