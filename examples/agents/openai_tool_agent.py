"""A multi-turn, tool-using agent written with nothing but the `openai` client: the kind of
program relayrl trains without touching its code.

    relayrl up --task lookup --agent "python examples/agents/openai_tool_agent.py"

relayrl starts it once per training sample with:
- OPENAI_BASE_URL / OPENAI_API_KEY: its own session on the gateway (the gateway records every
  token the policy generates; the agent sees an ordinary chat-completions API);
- RELAYRL_SESSION_URL: where it closes the session when done;
- the task as one JSON line on stdin: {"session_id", "messages", "labels", "extra_info",
  "sample_index"}.

It offers two tools, `calculator` and `lookup` (the values of the `lookup` task live in the
task's labels as `lookup:<key>`), runs them itself when the model calls them, and gives the
model their results until it answers or `MAX_TURNS` model calls are spent. Whatever it does,
the reward comes from the reward-service by the task's data_source; an agent with its own
verifier would add `{"env_reward": {...}}` to the close (docs/rewards.md).
"""

from __future__ import annotations

import sys
from typing import Any

import openai
from tools import (
    MAX_TURNS,
    NUDGE,
    TOOLS,
    close_session,
    needs_nudge,
    run_agent,
    run_tool,
    session_of,
)


def solve(task: dict[str, Any]) -> None:
    session = session_of(task)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=2)
    messages: list[dict[str, Any]] = list(task["messages"])
    nudged = False
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True))
        if not calls:
            if not needs_nudge(message.content, nudged):
                break
            messages.append({"role": "user", "content": NUDGE})
            nudged = True
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments, task["labels"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    client.close()
    close_session(session)


if __name__ == "__main__":
    sys.exit(run_agent(solve))
