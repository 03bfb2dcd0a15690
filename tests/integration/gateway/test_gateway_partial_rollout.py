"""Partial rollout and routing against real vLLM engines: a pause in `keep` or `abort` mode
across a version change yields one generation whose spans carry both versions and whose tokens
are a consistent continuation; sessions stick to their replica while it serves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.engine.process import EngineProcess
from relayrl.gateway.engine_session import StickySession
from relayrl.gateway.replicas import ReplicaPool, ReplicaState
from relayrl.inference.client import Generation, SamplingOptions, VllmEngineClient

PROMPT = (1, 40, 41, 42, 2, 1)
LONG = SamplingOptions(max_tokens=300, temperature=1.0, seed=3, ignore_eos=True)


def transformers_logprobs(model_dir: Path, tokens: tuple[int, ...]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([list(PROMPT) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()
    chosen = torch.tensor(tokens).unsqueeze(1)
    return torch.log_softmax(logits, dim=-1).gather(1, chosen).squeeze(1).tolist()


async def across_version_change(engine: EngineProcess, mode: str) -> Generation:
    pool = ReplicaPool(health_interval_s=60)
    try:
        replica = await pool.add("engine-0", VllmEngineClient(engine.url))
        await replica.client.set_weight_version("7")
        session = StickySession(pool, f"partial-{mode}", request_timeout_s=120)
        rollout = asyncio.create_task(session.generate(PROMPT, LONG))
        await asyncio.sleep(0.05)  # part of the 300 tokens is out
        await pool.pause([replica], mode)  # type: ignore[arg-type]
        assert replica.state is ReplicaState.PAUSED
        await asyncio.sleep(0.1)
        await pool.resume([replica], "8")
        return await rollout
    finally:
        await pool.close()


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_pause_across_a_version_change_gives_a_two_version_continuation(
    engine: EngineProcess, model_dir: Path, mode: str
) -> None:
    generation = asyncio.run(across_version_change(engine, mode))
    assert len(generation.token_ids) == len(generation.logprobs) == LONG.max_tokens
    assert generation.finish_reason == "length"
    spans = generation.version_spans
    assert [s.version for s in spans] == ["7", "8"], spans
    assert spans[0].start == 0 and spans[0].end == spans[1].start and spans[1].end == 300
    # Both versions hold the same weights here, so every token's log-prob must be what the
    # model gives it after exactly the prefix the trajectory records: a resubmission that
    # lost or duplicated a token would break this from that point on.
    expected = transformers_logprobs(model_dir, generation.token_ids)
    assert list(generation.logprobs) == pytest.approx(expected, abs=2e-3)


def test_sessions_stick_to_their_replica_and_move_only_when_it_dies(
    engine: EngineProcess, private_engine: Callable[..., EngineProcess]
) -> None:
    second = private_engine("second")  # killed below

    async def scenario() -> None:
        pool = ReplicaPool(health_interval_s=60)
        try:
            a = await pool.add("a", VllmEngineClient(engine.url))
            b = await pool.add("b", VllmEngineClient(second.url))
            short = SamplingOptions(max_tokens=4, temperature=1.0, seed=1)
            sessions = {f"s{k}": StickySession(pool, f"s{k}", 60) for k in range(6)}
            first: dict[str, str] = {}
            for name, session in sessions.items():
                await session.generate(PROMPT, short)
                first[name] = session.replica_id
            assert set(first.values()) == {"a", "b"}  # new sessions spread over replicas
            for _ in range(3):
                for name, session in sessions.items():
                    await session.generate(PROMPT, short)
                    assert session.replica_id == first[name]  # sticky
            second.kill()
            await pool.check(b)
            await pool.check(b)
            assert b.state is ReplicaState.UNHEALTHY and a.routable
            for session in sessions.values():
                await session.generate(PROMPT, short)
                assert session.replica_id == "a"
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        second.stop()
