"""A pydantic-ai `Agent` with a tool, unchanged but for where its model lives: an
`OpenAIChatModel` on an `OpenAIProvider` pointed at the sample's session.

    FW=.venv/share/venvs/frameworks/bin/python     # make setup builds it
    relayrl up --task lookup --agent-serve \\
        --agent "$FW examples/agents/pydantic_ai_agent.py --serve"

pydantic-ai runs the tool loop itself: each call of `lookup` is a turn of the same
conversation. When the model's output does not validate (a call to a tool that does not
exist, arguments that are not JSON) more often than pydantic-ai retries, it raises
`UnexpectedModelBehavior`: that is the model's doing, an answer to score, not an
infrastructure failure, so the agent ends the episode normally. `make setup` builds the
frameworks' virtual environment (`.venv/share/venvs/frameworks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from tools import run_agent, run_tool, session_of


async def run(task: dict[str, Any]) -> None:
    session = session_of(task)
    provider = OpenAIProvider(base_url=session["base_url"], api_key=session["api_key"])
    agent = Agent(
        OpenAIChatModel("policy", provider=provider),
        model_settings={"max_tokens": 96},
        retries=1,
    )
    labels = task["labels"]

    @agent.tool_plain
    def lookup(key: str) -> str:
        """Look up the value stored under a key."""
        return run_tool("lookup", json.dumps({"key": key}), labels)

    question = next(m["content"] for m in reversed(task["messages"]) if m["role"] == "user")
    # The model's doing: the session holds what it generated, scored as an answer.
    with contextlib.suppress(UnexpectedModelBehavior):
        await agent.run(question)


def solve(task: dict[str, Any]) -> None:
    asyncio.run(run(task))


if __name__ == "__main__":
    sys.exit(run_agent(solve))
