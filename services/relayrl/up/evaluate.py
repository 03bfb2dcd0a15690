"""Held-out accuracy of the policy the engine serves now.

Each held-out question is rolled out with the gateway's own agent loop for the task (the same
prompt rendering, tool calls and turn budget as training), greedily (temperature 0), and scored
by the reward-service's scorer for its data_source (`relayrl.up.workload.Judge`). Optionally a
second pass samples at the training temperature. Requests go straight to the engine, alongside the
gateway's rollouts; the record names the weight version at the start and at the end, so an
evaluation that straddles a weight switch is visible as such.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from relayrl.up.workload import Judge

MAX_CONCURRENT = 64


@dataclass
class EvalRecord:
    kind: str  # warm_start, periodic, final
    step: int  # trainer steps completed when it started
    version: int  # engine weight version at the start (-1: unversioned)
    version_end: int
    n: int
    correct: int
    accuracy: float  # greedy
    sampled_accuracy: float | None
    seconds: float
    time: float


class Evaluator:
    def __init__(
        self,
        judge: Judge,
        heldout_file: Path,
        tokenizer_dir: Path,
        *,
        max_tokens: int,
        max_turns: int = 4,
        temperature: float = 1.0,
        sampled: bool = True,
        engine_token: str | None = None,
    ) -> None:
        """`engine_token`: the operator's, for an engine that checks its callers."""
        from transformers import AutoTokenizer

        from relayrl.conversation.tools import ToolTable
        from relayrl.trainer.feeder import load_prompts

        self.judge = judge
        self.records = load_prompts(heldout_file)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.tools = ToolTable()
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.temperature = temperature
        self.sampled = sampled
        self.engine_token = engine_token

    def run(self, engine_url: str, kind: str, step: int) -> EvalRecord:
        return asyncio.run(self._run(engine_url, kind, step))

    async def _run(self, engine_url: str, kind: str, step: int) -> EvalRecord:
        from relayrl.gateway.agents import policy_version
        from relayrl.inference.client import VllmEngineClient

        started = time.monotonic()
        client = VllmEngineClient(engine_url, request_timeout_s=120.0, token=self.engine_token)
        try:
            version = policy_version(await client.weight_version())
            correct = await self._pass(client, 0.0, kind)
            sampled = None
            if self.sampled:
                sampled = await self._pass(client, self.temperature, kind) / len(self.records)
            version_end = policy_version(await client.weight_version())
        finally:
            await client.close()
        n = len(self.records)
        return EvalRecord(
            kind=kind,
            step=step,
            version=version,
            version_end=version_end,
            n=n,
            correct=correct,
            accuracy=correct / n,
            sampled_accuracy=sampled,
            seconds=round(time.monotonic() - started, 3),
            time=time.time(),
        )

    async def _pass(self, client, temperature: float, kind: str) -> int:
        from relayrl.gateway.agents import AgentContext, ClientSession, build_agent_loops
        from relayrl.inference.client import SamplingOptions
        from relayrl.proto.common.v1 import common_pb2

        loops = build_agent_loops()
        context = AgentContext(
            tokenizer=self.tokenizer,
            sampling=SamplingOptions(max_tokens=self.max_tokens, temperature=temperature),
            max_turns=self.max_turns,
            max_response_tokens=self.max_tokens,
            tools=self.tools,
        )
        gate = asyncio.Semaphore(MAX_CONCURRENT)
        tag = f"eval-{kind}-{int(time.time() * 1000)}-t{temperature:g}"

        async def one(i: int, record) -> bool:
            group = common_pb2.PromptGroup(
                uid=f"{tag}-{i}",
                messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in record.messages],
                data_source=record.data_source,
                ground_truth=record.ground_truth,
                agent=record.agent,
                labels=dict(record.labels),
            )
            async with gate:
                rollout = await loops[record.agent or "single_turn"].run(
                    group, ClientSession(client, group.uid), context
                )
            return await asyncio.to_thread(
                self.judge.correct, record.data_source, rollout.response_text,
                record.ground_truth,
            )  # fmt: skip

        # A TaskGroup: one failure (an engine going away) cancels the rest at once.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, r)) for i, r in enumerate(self.records)]
        return sum(task.result() for task in tasks)


def append_record(path: Path, record: EvalRecord) -> None:
    with path.open("a", encoding="utf-8") as log:
        log.write(json.dumps(asdict(record), sort_keys=True) + "\n")


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return records
