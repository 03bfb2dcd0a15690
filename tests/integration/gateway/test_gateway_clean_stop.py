"""A gateway that stops cleanly gives back the groups it has in flight, and one that starts
gives back what a dead process of its name left claimed: their claims are dropped and they are
pending at once, for the next claimer (a resumed run), instead of staying running until their
leases expire. Against a real redis-server; the agent loop is an in-process stand-in that never
finishes (this is the claim logic)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry

from relayrl.gateway.metrics import GatewayMetrics
from relayrl.gateway.replicas import ReplicaPool
from relayrl.gateway.rollout import RolloutWorker, Throttle
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import AsyncTransferQueue, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.queues import run_with_async_queue

P = "train"


class Endless:
    """An agent loop whose rollouts never end (a long generation at the moment of the stop)."""

    name = "single_turn"

    async def run(self, group: Any, session: Any, context: Any) -> Any:
        await asyncio.Event().wait()


def test_a_clean_stop_gives_back_the_groups_in_flight(
    tq: TransferQueue, redis_server: RedisServer
) -> None:
    tq.put_groups(
        P,
        [
            common_pb2.PromptGroup(uid=f"g{k}", num_samples=2, prompt_token_ids=[1])
            for k in range(3)
        ],
    )
    # a process of the same name, killed with g2 claimed for ten minutes
    tq.claim_named_groups(P, ["g2"], claimer="gw-test", lease_s=600)

    async def scenario(atq: AsyncTransferQueue) -> None:
        pool = ReplicaPool(health_interval_s=60, metrics=GatewayMetrics(CollectorRegistry()))
        worker = RolloutWorker(
            atq,
            pool,
            {"single_turn": Endless()},  # type: ignore[dict-item]
            lambda group, index: None,  # type: ignore[arg-type,return-value]
            partition=P,
            claimer="gw-test",
            throttle=Throttle(0, 2, 0.0),  # two of the three may launch
            lease_s=600,  # a lease that would hold the groups for ten minutes
            max_inflight_groups=8,
            request_timeout_s=10,
        )
        worker.start()
        try:
            deadline = time.monotonic() + 30
            while tq.counts(P).groups.get("running", 0) < 2:
                assert time.monotonic() < deadline, "the worker claimed nothing"
                await asyncio.sleep(0.05)
        finally:
            await worker.close()
            await pool.close()

    run_with_async_queue(redis_server, scenario)
    counts = tq.counts(P)
    assert counts.groups.get("running", 0) == 0 and counts.groups.get("pending") == 3
    assert counts.num_launched == 0 and tq.leases(P) == []
    reasons = {g.group.tags.reason for g in tq.get_groups(P, ["g0", "g1", "g2"])}
    assert reasons <= {"gateway stopped", "released by a restarted claimer"}
    assert "gateway stopped" in reasons
    again = tq.claim_groups(P, max_groups=3, claimer="resumed", lease_s=60)
    assert len(again.claimed) == 3  # at once, no lease to wait out
