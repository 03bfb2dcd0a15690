"""The same tool agent written with a real agent framework: the OpenAI Agents SDK
(`openai-agents`), unchanged but for where its model lives. The SDK runs the turn loop: it
sends Responses API requests (its default for OpenAI models; `--chat-completions` for chat
completions) to the session, calls the tools the model asks for, feeds their results back, and
stops when the model answers.

`make setup` builds the SDK's own virtual environment (it pins `websockets` below what relayrl's
lock has), so the agent runs with that interpreter:

    relayrl up --task lookup \\
        --agent ".venv/share/venvs/agents-sdk/bin/python examples/agents/agents_sdk_agent.py"

Importing the SDK takes about two CPU-seconds, so with `--serve` (and `agent.serve: true`) one
process takes every sample's task instead.

Only two settings point the SDK at relayrl: the model is `OpenAIResponsesModel` (or
`OpenAIChatCompletionsModel`) on an `AsyncOpenAI` client on the sample's session
(OPENAI_BASE_URL / OPENAI_API_KEY, or the task's `base_url` / `api_key` when served), and
tracing is off (it would export to OpenAI's servers).
The tools are `FunctionTool`s with the schemas the gateway's own tools have, so the prompt
renders as for relayrl's `tool_agent`. When the model stops without `Answer: <integer>`, the
agent asks once more for it, as the other example agents do.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI
from tools import MAX_TURNS, NUDGE, TOOLS, close_session, needs_nudge, run_tool, session_of

MODEL = OpenAIChatCompletionsModel if "--chat-completions" in sys.argv else OpenAIResponsesModel


def sdk_tools(labels: dict[str, str]) -> list[FunctionTool]:
    def tool(schema: dict[str, Any]) -> FunctionTool:
        function = schema["function"]

        async def invoke(_context: Any, arguments: str) -> str:
            return run_tool(function["name"], arguments, labels)

        return FunctionTool(
            name=function["name"],
            description=function["description"],
            params_json_schema=function["parameters"],
            on_invoke_tool=invoke,
            strict_json_schema=False,
        )

    return [tool(schema) for schema in TOOLS]


async def solve(task: dict[str, Any]) -> None:
    session = session_of(task)
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=2)
    agent = Agent(
        name="solver",
        model=MODEL(model="policy", openai_client=client),
        model_settings=ModelSettings(parallel_tool_calls=None),
        tools=sdk_tools(task["labels"]),
    )
    messages: list[Any] = [{"role": m["role"], "content": m["content"]} for m in task["messages"]]
    try:
        result = await Runner.run(agent, messages, max_turns=MAX_TURNS)
        if needs_nudge(str(result.final_output or ""), nudged=False):
            nudge = [*result.to_input_list(), {"role": "user", "content": NUDGE}]
            await Runner.run(agent, nudge, max_turns=MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):
        # Too many turns, or a call to a tool that does not exist or with arguments that are
        # not JSON: the model's doing, not the system's. The session holds every turn it took;
        # it is scored as a (probably wrong) answer, not reported as a failed rollout.
        pass
    finally:
        await client.close()


async def serve() -> None:
    """A served agent (`serve: true`): one task per stdin line, each solved concurrently on
    this process's event loop, one result line per task on stdout."""
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()

    async def one(task: dict[str, Any]) -> None:
        try:
            await solve(task)
            await asyncio.to_thread(close_session, session_of(task))
            error = None
        except Exception as exc:  # reported for this task; the others go on
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"session_id": task["session_id"], "error": error}), flush=True)

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip():
            task = asyncio.create_task(one(json.loads(line)))
            running.add(task)
            task.add_done_callback(running.discard)
    await asyncio.gather(*running)


def main() -> int:
    set_tracing_disabled(True)
    if "--serve" in sys.argv[1:]:  # the SDK's imports take seconds: pay them once
        asyncio.run(serve())
        return 0
    task = json.loads(sys.stdin.readline())
    asyncio.run(solve(task))
    close_session(session_of(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
