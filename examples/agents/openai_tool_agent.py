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

import ast
import json
import operator
import os
import sys
import urllib.request
from typing import Any

import openai

MAX_TURNS = 4
# The tools exactly as the gateway's built-in tool loop offers them, so that the chat template
# renders the same prompt for this agent as for relayrl's own `tool_agent`.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and "
            "parentheses.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "For example (12 + 30) * 2."}
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the value stored under a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "The key to look up."}},
                "required": ["key"],
                "additionalProperties": False,
            },
        },
    },
]
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> float | int:
    """+ - * / // % ** on numbers, nothing else (no names, no calls; small powers)."""

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exponent = value(node.left), value(node.right)
            if abs(exponent) > 64:
                raise ValueError("exponent too large")
            return base**exponent
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * / // % ** are allowed")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return value(ast.parse(expression, mode="eval").body)


def run_tool(name: str, arguments: str, labels: dict[str, str]) -> str:
    try:
        args = json.loads(arguments or "{}")
        if name == "lookup":
            key = str(args["key"])
            if f"lookup:{key}" not in labels:
                return json.dumps({"error": f"no value under key {key!r}"})
            return json.dumps({"result": labels[f"lookup:{key}"]})
        if name == "calculator":
            return json.dumps({"result": calculate(str(args["expression"]))})
        return json.dumps({"error": f"unknown tool {name!r}"})
    except (ValueError, KeyError, TypeError, ZeroDivisionError, SyntaxError) as exc:
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})


def close_session() -> None:
    """End the session: the gateway puts the trajectory it recorded, the reward-service
    scores it."""
    request = urllib.request.Request(
        os.environ["RELAYRL_SESSION_URL"] + "/close",
        data=b"{}",
        method="POST",
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the gateway is local
    with opener.open(request, timeout=60) as answer:
        answer.read()


def main() -> int:
    task = json.loads(sys.stdin.readline())
    client = openai.OpenAI(max_retries=2)  # OPENAI_BASE_URL and OPENAI_API_KEY from the env
    messages: list[dict[str, Any]] = list(task["messages"])
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True))
        if not calls:
            break
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments, task["labels"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    close_session()
    return 0


if __name__ == "__main__":
    sys.exit(main())
