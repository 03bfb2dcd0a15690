"""The staleness throttle against a real TransferQueue: launched < (v + 1 + eta) * B + refill
holds for eta = 0, 1, 2, opens by B groups per trainer step and by the trainer's refill credit.
The engine here is an in-process stand-in (this is the claim logic; the real-engine paths are
in test_gateway_service.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from relayrl.conversation.tools import ToolTable
from relayrl.gateway.agents import AgentContext, build_agent_loops
from relayrl.gateway.metrics import GatewayMetrics
from relayrl.gateway.replicas import ReplicaPool
from relayrl.gateway.rollout import RolloutWorker, Throttle
from relayrl.inference.client import (
    EngineClient,
    GenerateRequest,
    Generation,
    SamplingOptions,
    VersionSpan,
)
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import AsyncTransferQueue, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.queues import run_with_async_queue

P = "train"
B = 2


class InstantEngine(EngineClient):
    """Answers every generate at once with two tokens."""

    name = "instant"

    async def generate(self, request: GenerateRequest) -> Generation:
        await asyncio.sleep(0)
        return Generation(
            request.request_id, (5, 2), (-1.0, -0.5), "stop", (VersionSpan("0", 0, 2),)
        )

    async def health(self) -> bool:
        return True

    async def pause(self, mode: Any) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool:
        return False

    async def reset_prefix_cache(self) -> None: ...

    async def weight_version(self) -> str:
        return "0"

    async def set_weight_version(self, version: str) -> None: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def worker_rpc(self, method: str, payload: dict[str, Any]) -> list[Any]:
        return []

    async def close(self) -> None: ...


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from relayrl.models.tiny import TinyModelConfig, init_model

    directory = tmp_path_factory.mktemp("model") / "tiny"
    init_model(directory, TinyModelConfig())
    return AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_launches_stop_at_the_bound_and_open_by_b_per_step(
    tq: TransferQueue, redis_server: RedisServer, tokenizer: Any, eta: int
) -> None:
    def context_for(group: common_pb2.PromptGroup, index: int) -> AgentContext:
        return AgentContext(
            tokenizer=tokenizer,
            sampling=SamplingOptions(max_tokens=4),
            max_turns=1,
            max_response_tokens=4,
            tools=ToolTable(),
        )

    tq.put_groups(
        P,
        [
            common_pb2.PromptGroup(uid=f"g{k}", num_samples=2, prompt_token_ids=[1, 2])
            for k in range(12)
        ],
    )

    async def scenario(atq: AsyncTransferQueue) -> None:
        metrics = GatewayMetrics(CollectorRegistry())
        pool = ReplicaPool(health_interval_s=60, metrics=metrics)
        await pool.add("engine-0", InstantEngine())
        worker = RolloutWorker(
            atq,
            pool,
            build_agent_loops(),
            context_for,
            partition=P,
            claimer="gw-test",
            throttle=Throttle(0, B, float(eta)),
            lease_s=60,
            max_inflight_groups=64,
            request_timeout_s=10,
        )
        worker.start()
        try:
            for step in range(3):
                worker.update_policy_step(step)
                bound = (step + 1 + eta) * B
                await wait_for(lambda b=bound: tq.counts(P).groups.get("finished", 0) == b)
                await asyncio.sleep(0.5)  # more polls: nothing beyond the bound
                counts = tq.counts(P)
                assert counts.num_launched == bound
                assert counts.groups.get("finished", 0) == bound
                assert counts.groups.get("pending", 0) == 12 - bound
            # the trainer's refill credit (groups it evicted or filtered) opens the bound
            worker.update_policy_step(2, refill_groups=1)
            bound = (2 + 1 + eta) * B + 1
            await wait_for(lambda b=bound: tq.counts(P).groups.get("finished", 0) == b)
            await asyncio.sleep(0.5)
            assert tq.counts(P).num_launched == bound
        finally:
            await worker.close()
            await pool.close()

    run_with_async_queue(redis_server, scenario)


async def wait_for(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)
