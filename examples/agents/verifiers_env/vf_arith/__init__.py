"""A small verifiers environment, written as any verifiers 0.4 environment is (no relayrl in
it): arithmetic questions, a two-turn chat harness that asks once more when the reply has no
answer, and a rubric of three weighted rewards: the answer's correctness, its format, and the
reply's brevity.

Its taskset id is `vf-arith` (this package, on PYTHONPATH). examples/agents/verifiers_agent.py
runs it against relayrl; `make setup` builds the interpreter it needs."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

ANSWER = re.compile(r"Answer:\s*(-?\d+)")
QUESTIONS = 64
NUDGE = "Give your final answer in the form: Answer: <integer>"


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply or "")
        return 1.0 if found and int(found.group(1)) == task.answer else 0.0

    @vf.reward(weight=0.1)
    async def answered(self, trace: vf.Trace) -> float:
        return 1.0 if ANSWER.search(trace.last_reply or "") else 0.0

    @vf.reward(weight=0.1)
    async def concise(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply or "") / 100)


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self) -> Iterator[ArithTask]:
        draw = random.Random(0)
        for _ in range(QUESTIONS):
            a, b = draw.randint(2, 49), draw.randint(2, 49)
            data = ArithData(
                prompt=f"What is {a} + {b}?\nEnd your reply with: Answer: <integer>",
                answer=a + b,
            )
            yield ArithTask(data, self.config.task)


class NudgingChat(vf.Harness[vf.HarnessConfig]):
    """A chat loop run in-process (verifiers' harness contract allows it): every model call
    goes to the rollout's interception endpoint, which records the trace."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for turn in range(2):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                text = reply.choices[0].message.content or ""
                if turn == 1 or ANSWER.search(text):
                    break
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": NUDGE},
                ]
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ArithTaskset", "NudgingChat"]
