"""What the example agents share, standard library only: the two tools they offer (`calculator`
and `lookup`, exactly as relayrl's built-in tool loop offers them, so that the chat template
renders the same prompt for them as for relayrl's own `tool_agent`), running a tool call, the
session's calls, and the loop of a served agent (one process for every sample's task)."""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_TURNS = 4
# When the model stops without an answer in the task's format, the agent asks once more.
ANSWER_MARK = "Answer:"
NUDGE = "Give your final answer in the form: Answer: <integer>"


def needs_nudge(reply: str | None, nudged: bool) -> bool:
    """Whether to ask once more: the model's final reply has no `Answer:` yet."""
    return not nudged and ANSWER_MARK not in (reply or "")


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


def session_of(task: dict[str, Any]) -> dict[str, str]:
    """Where the task's session is: a served agent gets it in the task, a process of one
    sample in its environment."""
    if "base_url" in task:
        return {k: task[k] for k in ("base_url", "api_key", "session_url")}
    return {
        "base_url": os.environ["OPENAI_BASE_URL"],
        "api_key": os.environ["OPENAI_API_KEY"],
        "session_url": os.environ["RELAYRL_SESSION_URL"],
    }


def post(url: str, body: dict[str, Any], api_key: str) -> dict[str, Any]:
    """POST JSON with the session's token; the answer's JSON."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the gateway is local
    with opener.open(request, timeout=120) as answer:
        return json.loads(answer.read())


def close_session(session: dict[str, str], env_reward: dict[str, Any] | None = None) -> None:
    """End the session: the gateway puts the trajectory it recorded, the reward-service
    scores it. An agent with its own verifier reports its reward here (docs/rewards.md)."""
    body = {} if env_reward is None else {"env_reward": env_reward}
    post(session["session_url"] + "/close", body, session["api_key"])


def serve(solve: Callable[[dict[str, Any]], None], max_workers: int = 64) -> int:
    """A served agent's loop (`serve: true`): one task per stdin line, each solved on a thread
    of its own, one result line per task on stdout."""
    lock = threading.Lock()

    def one(line: str) -> None:
        task = json.loads(line)
        try:
            solve(task)
            error = None
        except Exception as exc:  # reported for this task; the others go on
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            print(json.dumps({"session_id": task["session_id"], "error": error}), flush=True)

    with ThreadPoolExecutor(max_workers) as pool:
        for line in sys.stdin:
            if line.strip():
                pool.submit(one, line)
    return 0


def run_agent(solve: Callable[[dict[str, Any]], None]) -> int:
    """An example agent's entry point: with `--serve`, every sample's task (`serve: true`);
    else the one task on stdin (a process per sample)."""
    if "--serve" in sys.argv[1:]:
        return serve(solve)
    solve(json.loads(sys.stdin.readline()))
    return 0
