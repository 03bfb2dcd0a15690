"""Held-out accuracy of the policy the engine serves now.

Each held-out question is rolled out with the gateway's own agent loop for the task (the same
prompt rendering, tool calls and turn budget as training), greedily (temperature 0), and scored
by the reward-service's scorer for its data_source (`relayrl.up.workload.Judge`). Optionally a
second pass samples at the training temperature. Requests go straight to the engine, alongside the
gateway's rollouts; the record names the first and the last weight version that served its
tokens (from the engine's own version spans), so an evaluation that straddles a weight switch is
visible as such. Reading the engine's label instead would name no version when an evaluation
starts or ends while a version loads (the label then says `loading-<n>`), although every token
was computed by a committed one: the engine is paused while it loads. Every greedy answer is kept in
`<responses_dir>/<kind>-<step>.jsonl`, so that an accuracy can be read back answer by answer.

A request's deadline follows the engine's measured speed: the time `MAX_CONCURRENT` requests of
`max_tokens` take at the speed the last evaluation measured (or a one-request probe, the first
time), times `DEADLINE_FACTOR`. A real model on a CPU engine is slow; its evaluation is not a
timeout, while a dead engine still ends it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from relayrl.core.records import EvalRecord, Record
from relayrl.up.workload import Judge

MAX_CONCURRENT = 64
DEADLINE_FACTOR = 3.0
MIN_DEADLINE_S = 120.0
PROBE_TOKENS = 32


class Answer(Record):
    """One greedy answer of an evaluation (a line of its responses file)."""

    index: int
    data_source: str
    ground_truth: str
    response: str
    correct: bool
    tokens: int
    versions: list[int] = []  # the weight versions that served its tokens, in order


def served_range(answers: list[Answer], label_start: int, label_end: int) -> tuple[int, int]:
    """The first and the last weight version that served `answers`' tokens (versions only go
    forward while an evaluation runs); the engine's labels at the start and the end when no
    token was generated. -1 is kept: tokens no version served are what an audit must see."""
    served = [v for a in answers for v in a.versions]
    return (min(served), max(served)) if served else (label_start, label_end)


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
        responses_dir: Path | None = None,
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
        self.responses_dir = responses_dir
        self.tokens_per_s: float | None = None
        """The engine's speed in the last evaluation (every request together)."""

    def run(self, engine_url: str, kind: str, step: int) -> EvalRecord:
        return asyncio.run(self._run(engine_url, kind, step))

    def deadline_s(self) -> float:
        """A request's deadline: `MAX_CONCURRENT` requests of max_tokens at the measured speed,
        DEADLINE_FACTOR times over."""
        assert self.tokens_per_s is not None, "measure first"
        expected = MAX_CONCURRENT * self.max_tokens / max(self.tokens_per_s, 1e-3)
        return max(MIN_DEADLINE_S, DEADLINE_FACTOR * expected)

    async def _probe(self, client) -> None:
        """The speed of one short greedy request alone: a floor for many at once."""
        from relayrl.inference.client import GenerateRequest, SamplingOptions

        prompt = self.tokenizer.encode("Count from one to twenty:", add_special_tokens=False)
        started = time.monotonic()
        generation = await client.generate(
            GenerateRequest(
                request_id=f"eval-probe-{int(time.time() * 1000)}",
                prompt_token_ids=tuple(prompt),
                sampling=SamplingOptions(max_tokens=PROBE_TOKENS, temperature=0.0),
            )
        )
        seconds = time.monotonic() - started
        self.tokens_per_s = max(1, len(generation.token_ids)) / max(seconds, 1e-3)

    async def _run(self, engine_url: str, kind: str, step: int) -> EvalRecord:
        from relayrl.gateway.agents import policy_version
        from relayrl.inference.client import VllmEngineClient

        started = time.monotonic()
        if self.tokens_per_s is None:
            probe = VllmEngineClient(engine_url, request_timeout_s=600.0, token=self.engine_token)
            try:
                await self._probe(probe)
            finally:
                await probe.close()
        client = VllmEngineClient(
            engine_url, request_timeout_s=self.deadline_s(), token=self.engine_token
        )
        try:
            label_start = policy_version(await client.weight_version())
            greedy_started = time.monotonic()
            answers = await self._pass(client, 0.0, kind)
            tokens = sum(a.tokens for a in answers)
            self.tokens_per_s = tokens / max(time.monotonic() - greedy_started, 1e-3)
            sampled, sampled_answers = None, []
            if self.sampled:
                sampled_answers = await self._pass(client, self.temperature, kind)
                sampled = sum(a.correct for a in sampled_answers) / len(self.records)
            label_end = policy_version(await client.weight_version())
        finally:
            await client.close()
        version, version_end = served_range(answers + sampled_answers, label_start, label_end)
        self._write_answers(kind, step, answers)
        n = len(self.records)
        correct = sum(a.correct for a in answers)
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
            tokens=tokens,
        )

    def _write_answers(self, kind: str, step: int, answers: list[Answer]) -> None:
        if self.responses_dir is None:
            return
        self.responses_dir.mkdir(parents=True, exist_ok=True)
        path = self.responses_dir / f"{kind}-{step}.jsonl"
        path.write_text("".join(a.to_line() + "\n" for a in answers), encoding="utf-8")

    async def _pass(self, client, temperature: float, kind: str) -> list[Answer]:
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

        async def one(i: int, record) -> Answer:
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
            versions = [s.policy_version for s in rollout.spans if s.generated]
            correct = await asyncio.to_thread(
                self.judge.correct, record.data_source, rollout.response_text,
                record.ground_truth,
            )  # fmt: skip
            return Answer(
                index=i, data_source=record.data_source, ground_truth=record.ground_truth,
                response=rollout.response_text, correct=bool(correct),
                tokens=int(sum(rollout.response_mask)),
                versions=list(dict.fromkeys(versions)),
            )  # fmt: skip

        # A TaskGroup: one failure (an engine going away) cancels the rest at once.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, r)) for i, r in enumerate(self.records)]
        return [task.result() for task in tasks]
