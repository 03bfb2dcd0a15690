"""Every request shape agent frameworks send, walked against a real gateway on the tiny model's
real vLLM engine with the official `openai` client's wire format: each shape either works
(200, an answer of OpenAI's shape) or is refused with OpenAI's error body naming the parameter.

docs/openai-surface.md is this walk's table. The test fails when the table differs from the
walk; `RELAYRL_WRITE_SURFACE=1` rewrites it from the walk."""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.process import EngineProcess
from relayrl.tq.server import RedisServer

pytestmark = pytest.mark.slow

MODEL = "policy"
DOC = Path(__file__).resolve().parents[3] / "docs" / "openai-surface.md"
HELLO = [{"role": "user", "content": "What is 2 + 3?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@dataclass(frozen=True)
class Shape:
    route: str  # "chat", "completions", "responses"
    name: str
    body: dict[str, Any]
    # None: it works; else the parameter the refusal names.
    refused: str | None = None


def chat(name: str, refused: str | None = None, **fields: Any) -> Shape:
    return Shape("chat", name, {"model": MODEL, "messages": HELLO, **fields}, refused)


def completion(name: str, refused: str | None = None, **fields: Any) -> Shape:
    return Shape("completions", name, {"model": MODEL, "prompt": "2 + 3 =", **fields}, refused)


def responses(name: str, refused: str | None = None, **fields: Any) -> Shape:
    return Shape("responses", name, {"model": MODEL, "input": HELLO, **fields}, refused)


RESPONSES_TOOL = {"type": "function", **TOOL["function"]}

SHAPES = [
    chat("plain"),
    chat("system and user", messages=[{"role": "system", "content": "Be brief."}, *HELLO]),
    chat("developer message", messages=[{"role": "developer", "content": "Be brief."}, *HELLO]),
    chat(
        "content as text parts",
        messages=[{"role": "user", "content": [{"type": "text", "text": "2+3?"}]}],
    ),
    chat(
        "image part",
        "messages",
        messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
        ],
    ),
    chat("max_tokens", max_tokens=8),
    chat("max_completion_tokens", max_completion_tokens=8),
    chat("temperature, top_p", temperature=0.7, top_p=0.9),
    chat("seed", seed=7),
    chat("stop: one string", stop="\n"),
    chat("stop: several, multi-token", stop=["\n\n", "Observation:"]),
    chat("stream", stream=True),
    chat("stream with include_usage", stream=True, stream_options={"include_usage": True}),
    chat("logprobs", logprobs=True),
    chat("logprobs with top_logprobs", logprobs=True, top_logprobs=5),
    chat("top_logprobs without logprobs", "top_logprobs", top_logprobs=2),
    chat("tools", tools=[TOOL]),
    chat("tool_choice: auto", tools=[TOOL], tool_choice="auto"),
    chat("tool_choice: none", tools=[TOOL], tool_choice="none"),
    chat("tool_choice: required", tools=[TOOL], tool_choice="required", max_tokens=200),
    chat(
        "tool_choice: a named function",
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=200,
    ),
    chat("parallel_tool_calls: true", tools=[TOOL], parallel_tool_calls=True),
    chat("parallel_tool_calls: false", tools=[TOOL], parallel_tool_calls=False),
    chat("response_format: text", response_format={"type": "text"}),
    chat("response_format: json_object", response_format={"type": "json_object"}),
    chat(
        "response_format: json_schema",
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    ),
    chat("structured_outputs (vLLM)", structured_outputs={"regex": "[0-9]+"}),
    chat("n: 1", n=1),
    chat("n: 2", "n", n=2),
    chat("user, metadata, store", user="u1", metadata={"k": "v"}, store=False),
    chat("presence_penalty", "presence_penalty", presence_penalty=0.5),
    chat("frequency_penalty", "frequency_penalty", frequency_penalty=0.5),
    chat("logit_bias", "logit_bias", logit_bias={"1": 5}),
    chat("return_token_ids (vLLM)", return_token_ids=True),
    chat("another model's name", "model", model="gpt-4o-mini"),
    completion("plain"),
    completion("prompt as token ids", prompt=[17, 18, 19]),
    completion("prompt as a list of one string", prompt=["2 + 3 ="]),
    completion("several prompts", "prompt", prompt=["a", "b"]),
    completion("max_tokens, temperature, seed", max_tokens=8, temperature=0.5, seed=3),
    completion("stop: several, multi-token", stop=["\n\n", " ="]),
    completion("stream", stream=True),
    completion("stream with include_usage", stream=True, stream_options={"include_usage": True}),
    completion("logprobs: 0", logprobs=0),
    completion("logprobs: 3", logprobs=3),
    completion("logprobs: 6", "logprobs", logprobs=6),
    completion("echo", "echo", echo=True),
    completion("suffix", "suffix", suffix="!"),
    completion("n: 2", "n", n=2),
    completion("best_of: 2", "best_of", best_of=2),
    completion("response_format: json_object", response_format={"type": "json_object"}),
    responses("input: a string", input="What is 2 + 3?"),
    responses(
        "input: message items",
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "2 + 3?"}],
            }
        ],
    ),
    responses("instructions", instructions="Be brief."),
    responses("function tools", tools=[RESPONSES_TOOL]),
    responses(
        "function_call and its output",
        tools=[RESPONSES_TOOL],
        input=[
            *HELLO,
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "add",
                "arguments": '{"a": 2, "b": 3}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "5"},
        ],
    ),
    responses("tool_choice: auto", tools=[RESPONSES_TOOL], tool_choice="auto"),
    responses(
        "tool_choice: required",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        max_output_tokens=200,
    ),
    responses(
        "tool_choice: a named function",
        tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=200,
    ),
    chat(
        "tool_choice: a function not among the tools",
        "tool_choice",
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "mul"}},
    ),
    responses("built-in tool (web_search)", "tools", tools=[{"type": "web_search"}]),
    responses("parallel_tool_calls", tools=[RESPONSES_TOOL], parallel_tool_calls=False),
    responses(
        "max_output_tokens, temperature, top_p", max_output_tokens=8, temperature=0.7, top_p=0.9
    ),
    responses(
        "text.format: json_schema",
        text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}},
    ),
    responses("text.format: json_object", text={"format": {"type": "json_object"}}),
    responses("stream", stream=True),
    responses(
        "include output_text.logprobs, top_logprobs",
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    ),
    responses(
        "store, metadata, user, truncation",
        store=False,
        metadata={"k": "v"},
        user="u",
        truncation="disabled",
    ),
    responses("previous_response_id", "previous_response_id", previous_response_id="resp_1"),
    responses("conversation", "conversation", conversation="conv_1"),
    responses("reasoning item in input", "input", input=[{"type": "reasoning", "summary": []}]),
    Shape("embeddings", "any input", {"model": MODEL, "input": "x"}, "(route)"),
]
PATHS = {
    "chat": "chat/completions",
    "completions": "completions",
    "responses": "responses",
    "embeddings": "embeddings",
}


def forced(shape: Shape) -> bool:
    """Whether the shape forces a tool call (tool_choice "required" or a named function)."""
    return shape.refused is None and shape.body.get("tool_choice") not in (None, "auto", "none")


def cut_call(finish_reason: str, text: str) -> bool:
    """A forced call the budget cut short: the random tiny model may write a long argument."""
    return finish_reason == "length" and text.startswith('<tool_call>\n{"name": "add"')


def gateway_config(redis: RedisServer, model_dir: Path, engine_url: str) -> dict[str, Any]:
    return {
        "tq": {"url": redis.url},
        "tokenizer": str(model_dir),
        "engines": {"urls": [engine_url], "health_interval_s": 0.5, "request_timeout_s": 60},
        "rollout": {"partitions": []},
        "agent_http": {
            "model_name": MODEL,
            "max_tokens": 200,
            "default_max_tokens": 8,
            "adhoc_sessions": True,
        },
    }


async def walk(base: str) -> list[tuple[Shape, int, dict[str, Any] | None]]:
    """Each shape as the first request of a session of its own: (shape, status, error)."""
    seen = []
    async with aiohttp.ClientSession(trust_env=False) as http:
        for shape in SHAPES:
            async with http.post(f"{base}/sessions", json={"data_source": "x"}) as opened:
                session_id = (await opened.json())["session_id"]
            url = f"{base}/sessions/{session_id}/v1/{PATHS[shape.route]}"
            async with http.post(url, json=shape.body) as response:
                raw = await response.read()
                status = response.status
            error = None
            if status != 200:
                error = json.loads(raw)["error"]
            elif shape.body.get("stream") and shape.route == "responses":
                events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
                last = json.loads(events[-1][6:])
                assert last["type"] in ("response.completed", "response.incomplete"), last
                assert last["response"]["usage"]["output_tokens"] >= 1, last
            elif shape.body.get("stream"):
                events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]", (shape.name, raw[-200:])
                chunks = [json.loads(line[6:]) for line in events[:-1]]
                usage = [c for c in chunks if c.get("usage")]
                assert bool(usage) == bool(shape.body.get("stream_options")), shape.name
            elif shape.route == "responses":
                answer = json.loads(raw)
                assert answer["object"] == "response" and answer["output"], answer
                assert answer["usage"]["output_tokens"] >= 1, answer
                if forced(shape):
                    kinds = [item["type"] for item in answer["output"]]
                    text = answer["output"][0].get("content", [{}])[0].get("text", "")
                    finish = "length" if answer["status"] == "incomplete" else "stop"
                    assert "function_call" in kinds or cut_call(finish, text), answer
            else:
                answer = json.loads(raw)
                assert answer["choices"] and answer["usage"]["completion_tokens"] >= 1, answer
                if forced(shape):  # the engine generated a call, and the answer has it
                    (choice,) = answer["choices"]
                    assert choice["message"].get("tool_calls") or cut_call(
                        choice["finish_reason"], choice["message"]["content"]
                    ), json.dumps(answer)
            seen.append((shape, status, error))
            async with http.post(f"{base}/sessions/{session_id}/close", json={}):
                pass
    return seen


def table(seen: list[tuple[Shape, int, dict[str, Any] | None]]) -> str:
    lines = [
        "# The OpenAI surface: every request shape and what the gateway does with it",
        "",
        "Generated by `tests/integration/gateway/test_gateway_openai_surface.py`, which sends",
        "each shape as the first request of an agent session to a real gateway on a real vLLM",
        "engine (`RELAYRL_WRITE_SURFACE=1` rewrites this file). *works*: 200 and an answer of",
        "OpenAI's shape. *refused*: OpenAI's error body, whose `param` names the field and",
        "whose message says what to send instead. Fields the table does not list are ignored,",
        "as OpenAI-compatible servers do with fields they do not know.",
        "",
        "| route | shape | status | what the gateway says |",
        "|---|---|---|---|",
    ]
    for shape, status, error in seen:
        route = f"`/v1/{PATHS[shape.route]}`"
        if error is None:
            lines.append(f"| {route} | {shape.name} | works | |")
        else:
            message = error["message"].replace("|", "\\|").replace("\n", " ")
            message = re.sub("[0-9a-f]{32}", "<id>", message)  # a session's id
            lines.append(f"| {route} | {shape.name} | refused ({status}) | {message} |")
    return "\n".join(lines) + "\n"


def test_every_request_shape_works_or_is_refused_naming_its_parameter(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    config = gateway_config(redis_server, model_dir, engine.url)
    with ServiceProcess("relayrl-gateway", config, tmp_path / "gw") as process:
        ready = json.loads(process.ready_file.read_text())
        seen = asyncio.run(walk(f"http://127.0.0.1:{ready['agent_http_port']}"))
    for shape, status, error in seen:
        if shape.refused is None:
            assert status == 200, (shape.name, error)
        elif shape.refused == "(route)":
            assert status == 404 and error is not None, (shape.name, status)
        else:
            assert status in (400, 404) and error is not None, (shape.name, status)
            assert error["param"] == shape.refused and error["message"], (shape.name, error)
    written = table(seen)
    if os.environ.get("RELAYRL_WRITE_SURFACE") == "1":
        DOC.write_text(written)
    assert DOC.read_text() == written, (
        f"{DOC} is not this walk's table; rewrite it with RELAYRL_WRITE_SURFACE=1"
    )
