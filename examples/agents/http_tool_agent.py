"""The same multi-turn tool agent as openai_tool_agent.py with no SDK at all: chat completions
as plain HTTP requests from the standard library. The gateway's agent endpoint is the OpenAI
chat-completions API, so this is all an agent needs.

    relayrl up --task lookup --agent "python examples/agents/http_tool_agent.py"

With `--serve` it is a served agent (the gateway's `serve: true`): one process takes every
sample's task from stdin, each on a thread, so Python starts once rather than per sample.
"""

from __future__ import annotations

import sys
from typing import Any

from tools import (
    MAX_TURNS,
    NUDGE,
    TOOLS,
    close_session,
    needs_nudge,
    post,
    run_agent,
    run_tool,
    session_of,
)


def solve(task: dict[str, Any]) -> None:
    session = session_of(task)
    url = session["base_url"] + "/chat/completions"
    messages: list[dict[str, Any]] = list(task["messages"])
    nudged = False
    for _ in range(MAX_TURNS):
        body = {"model": "policy", "messages": messages, "tools": TOOLS}
        message = post(url, body, session["api_key"])["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        messages.append({k: v for k, v in message.items() if v is not None})
        if not calls:
            if not needs_nudge(message.get("content"), nudged):
                break
            messages.append({"role": "user", "content": NUDGE})
            nudged = True
        for call in calls:
            function = call["function"]
            result = run_tool(function["name"], function["arguments"], task["labels"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    close_session(session)


if __name__ == "__main__":
    sys.exit(run_agent(solve))
