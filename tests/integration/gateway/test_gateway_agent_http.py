"""The agent gateway for black-box agents, end to end: a real redis-server, a real vLLM engine on
the tiny model, the real `relayrl-gateway` process, and agents written with the official
`openai` client against `/sessions/<id>/v1`.

The gateway does the token accounting: a multi-turn tool conversation comes back from the
TransferQueue as one trajectory whose prompt is the chat template's, whose generated tokens
are the engine's own (mask 1, log-probs, version and replica spans) and whose tool results and
user turns are the template's tokens (mask 0), every turn's engine prompt a byte-identical
prefix of the next. The random tiny model does not call tools by itself: the agent steers the
turns that must call one with vLLM structured outputs passed through the gateway
(`extra_body={"structured_outputs": {"regex": ...}}`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relayrl.core.grpc_client import make_channel
from relayrl.core.interceptors import token_digest
from relayrl.core.service_process import ServiceProcess
from relayrl.engine.process import EngineProcess
from relayrl.gateway.agent_http import (
    AgentError,
    AgentSessions,
    ChatRequest,
    ErrorKind,
    SessionSpec,
    TurnSampling,
)
from relayrl.gateway.config import AgentHttpConfig
from relayrl.gateway.replicas import ReplicaPool
from relayrl.inference.client import (
    EngineClient,
    EngineUnavailable,
    GenerateRequest,
    Generation,
    VersionSpan,
)
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from relayrl.tq import AsyncTransferQueue, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.queues import run_with_async_queue

pytestmark = pytest.mark.slow

MODEL = "policy"
AGENT_PARTITION = "agent"
TOOLS = [
    {
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
]
STEP_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


class Gateway:
    """The gateway process and the ways in: its agent HTTP endpoint and its gRPC service."""

    def __init__(self, process: ServiceProcess) -> None:
        self.process = process
        ready = json.loads(process.ready_file.read_text())
        self.http = f"http://127.0.0.1:{ready['agent_http_port']}"

    def agent(self, session_id: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.http}/sessions/{session_id}/v1", api_key="x", max_retries=0
        )

    async def post(self, path: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        async with aiohttp.ClientSession(trust_env=False) as http:
            data = body if isinstance(body, bytes | str) else json.dumps(body or {})
            async with http.post(self.http + path, data=data, **kwargs) as response:
                return response.status, await response.json(content_type=None)

    async def get(self, path: str) -> Any:
        async with (
            aiohttp.ClientSession(trust_env=False) as http,
            http.get(self.http + path) as response,
        ):
            return await response.json()

    async def open(self, **spec: Any) -> str:
        status, body = await self.post("/sessions", spec)
        assert status == 201, body
        return body["session_id"]

    def rpc(self, call: Callable[[rollout_pb2_grpc.RolloutGatewayStub], Any]) -> Any:
        async def main() -> Any:
            async with make_channel(self.process.target, default_timeout_s=30) as channel:
                return await call(rollout_pb2_grpc.RolloutGatewayStub(channel))

        return asyncio.run(main())


def gateway(
    redis: RedisServer, model_dir: Path, urls: list[str], workdir: Path, **agent_http: Any
) -> ServiceProcess:
    config = {
        "tq": {"url": redis.url},
        "tokenizer": str(model_dir),
        "engines": {"urls": urls, "health_interval_s": 0.5, "request_timeout_s": 60},
        # No rollout loop: only agent sessions touch the TransferQueue here.
        "rollout": {"partitions": []},
        "agent_http": {
            "model_name": MODEL,
            "max_tokens": 200,
            "default_max_tokens": 16,
            "adhoc_sessions": True,  # callers open their own one-sample groups here
            **agent_http,
        },
    }
    return ServiceProcess("relayrl-gateway", config, workdir)


def call_regex(name: str, **arguments: Any) -> str:
    text = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    return re.escape(text)


def steer(regex: str, **extra: Any) -> dict[str, Any]:
    return {"structured_outputs": {"regex": regex}, "return_token_ids": True, **extra}


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


async def scripted_sessions(
    tq: AsyncTransferQueue, tokenizer: PreTrainedTokenizerBase, *, health_checks: bool = False
) -> tuple[ReplicaPool, ScriptedEngine, AgentSessions]:
    """Started agent sessions on one scripted engine replica (`engine-0`)."""
    pool = ReplicaPool(health_interval_s=0.1)
    engine = ScriptedEngine(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    await pool.add("engine-0", engine)
    if health_checks:
        pool.start_health_checks()
    sessions = AgentSessions(
        tq=tq,
        pool=pool,
        tokenizer=tokenizer,
        config=AgentHttpConfig(),
        claimer="test",
        lease_s=60,
        request_timeout_s=10,
    )
    await sessions.start()
    return pool, engine, sessions


def rescored_logprobs(model_dir: Path, trajectory: common_pb2.Trajectory) -> list[float]:
    """Response log-probs under transformers, teacher-forced on the recorded trajectory."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(trajectory.prompt_token_ids)
    ids = prompt + list(trajectory.response_token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    per_token = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return per_token[len(prompt) - 1 :, 0].tolist()


# --- a whole conversation ----------------------------------------------------------------------


def test_a_multi_turn_tool_conversation_is_recorded_token_for_token(
    redis_server: RedisServer,
    model_dir: Path,
    engine: EngineProcess,
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    question = [{"role": "user", "content": "What is 2 + 2? Use the tool."}]

    async def agent(gw: Gateway, session_id: str) -> list[Any]:
        client = gw.agent(session_id)
        messages: list[Any] = list(question)
        answers = []
        # Turn 0: the call (steered), answered by the agent's own tool.
        first = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            max_tokens=60,
            extra_body=steer(call_regex("add", a=2, b=2)),
        )
        answers.append(first)
        call = first.choices[0].message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        result = arguments["a"] + arguments["b"]
        messages += [
            first.choices[0].message,  # the client's own object, as agents append it
            {"role": "tool", "tool_call_id": call.id, "content": str(result)},
        ]
        # Turn 1: the answer after the tool result (steered).
        second = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            max_tokens=20,
            extra_body=steer(re.escape("Answer: 4")),
        )
        answers.append(second)
        messages += [
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Thanks. Say more."},
        ]
        # Turn 2: a free generation after a user turn, with log-probs.
        request = {
            "model": MODEL,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 16,
            "seed": 5,
            "logprobs": True,
            "extra_body": {"return_token_ids": True},
        }
        third = await client.chat.completions.create(**request)
        answers.append(third)
        # A client retry of the same request gets the recorded answer, not a new sample.
        again = await client.chat.completions.create(**request)
        assert again.model_dump() == third.model_dump()
        return answers

    tq = TransferQueue(redis_server.client())
    with gateway(redis_server, model_dir, [engine.url], tmp_path / "gw") as process:
        gw = Gateway(process)
        # labels of an environment reward's old names are only labels: the close reports it
        posing = {"env_reward": "1.0", "env_reward_status": "ok"}
        session_id = asyncio.run(gw.open(data_source="env", labels={"task": "add", **posing}))
        first, second, third = asyncio.run(agent(gw, session_id))
        env_reward = {"status": "fail", "score": 0.25, "message": "2 of 8 checks"}
        status, end = asyncio.run(
            gw.post(f"/sessions/{session_id}/close", {"env_reward": env_reward})
        )
        assert status == 200, end
        # Closing twice returns how the session ended.
        assert asyncio.run(gw.post(f"/sessions/{session_id}/close")) == (200, end)

    # What the agent saw.
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 2}
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "Answer: 4"
    assert not second.choices[0].message.tool_calls
    assert third.choices[0].finish_reason in ("stop", "length")
    assert len(third.choices[0].logprobs.content) == third.usage.completion_tokens
    assert all(t.model_extra["relayrl"]["replica"] == "engine-0" for t in (first, second, third))
    assert [t.model_extra["relayrl"]["turn"] for t in (first, second, third)] == [0, 1, 2]

    # What the TransferQueue holds.
    assert end["outcome"] == "finished" and end["num_turns"] == 3
    (entry,) = tq.get_groups(AGENT_PARTITION, [f"agent-{session_id}"])
    assert end["trajectory_key"] == f"agent-{session_id}_0"
    group = entry.group
    assert (group.num_samples, group.data_source, group.ground_truth) == (1, "env", "")
    assert group.labels["task"] == "add" and group.agent == "agent_http"
    assert group.tags.status == common_pb2.GROUP_STATUS_FINISHED
    (trajectory,) = entry.trajectories
    assert trajectory.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
    assert not trajectory.tags.is_infra and not trajectory.error
    assert trajectory.labels["agent_session"] == session_id and trajectory.labels["task"] == "add"
    # the environment's reward as the close reported it, for the reward-service's `env`
    # manager; the opener's labels stay labels
    assert trajectory.env_reward == common_pb2.EnvReward(
        status=common_pb2.ENV_REWARD_STATUS_FAIL, score=0.25, message="2 of 8 checks"
    )
    assert {k: trajectory.labels[k] for k in posing} == posing

    prompt = list(trajectory.prompt_token_ids)
    response = list(trajectory.response_token_ids)
    rendered = tokenizer.apply_chat_template(
        question, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert prompt == encode(tokenizer, rendered) == list(group.prompt_token_ids)
    # Every turn's engine prompt is the recorded context so far, token for token, and the
    # turn's tokens are the engine's, verbatim.
    answers = [a.model_dump() for a in (first, second, third)]
    generated = [s for s in trajectory.spans if s.generated]
    observed = [s for s in trajectory.spans if not s.generated]
    assert [s.turn for s in generated] == [0, 1, 2] and [s.turn for s in observed] == [0, 1]
    for span, answer in zip(generated, answers, strict=True):
        assert answer["prompt_token_ids"] == prompt + response[: span.start]
        assert answer["choices"][0]["token_ids"] == response[span.start : span.end]
        assert (span.policy_version, span.replica) == (0, "engine-0")
    assert generated[-1].end == len(response)
    # Masks: 1 on the engine's tokens, 0 on the tool result and the user turn.
    mask = trajectory.response_mask
    assert len(mask) == len(response) == len(trajectory.rollout_logprobs)
    for span in trajectory.spans:
        assert set(mask[span.start : span.end]) == {int(span.generated)}
        logprobs = trajectory.rollout_logprobs[span.start : span.end]
        assert all(lp <= 0.0 for lp in logprobs) if span.generated else set(logprobs) == {0.0}
    free = generated[2]
    assert list(trajectory.rollout_logprobs[free.start : free.end]) == pytest.approx(
        [entry.logprob for entry in third.choices[0].logprobs.content], abs=1e-6
    )
    # The observations are the template's text after an assistant turn: the tool result, then
    # the user turn. A turn that ended on <|im_end|> keeps it and the observation does not
    # repeat it; one that ended on the other stop token (<|endoftext|>, which a finished
    # regex lets the engine sample too) keeps that and the observation closes the turn.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = [tokenizer.decode(response[s.start : s.end]) for s in observed]
    closings = ["\n" if response[s.start - 1] == im_end else "<|im_end|>\n" for s in observed]
    tool_turn = "<|im_start|>user\n<tool_response>\n4\n</tool_response>"
    assert texts[0] == closings[0] + tool_turn + STEP_SUFFIX
    assert texts[1] == closings[1] + "<|im_start|>user\nThanks. Say more." + STEP_SUFFIX
    # The steered turns generated what the template renders for those messages, so the whole
    # trajectory is the template's rendering of the conversation, byte for byte (but for the
    # <|endoftext|> a turn may have stopped on).
    conversation = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "4"},
        {"role": "assistant", "content": "Answer: 4"},
        {"role": "user", "content": "Thanks. Say more."},
    ]
    head = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    recorded = tokenizer.decode(prompt + response[: free.start])
    assert recorded.replace("<|endoftext|>", "") == head
    # The trainer's re-scoring of the recorded sequence gives the engine's log-probs on the
    # free turn: its context reached the engine exactly as recorded.
    rescored = rescored_logprobs(model_dir, trajectory)
    assert list(trajectory.rollout_logprobs[free.start : free.end]) == pytest.approx(
        rescored[free.start : free.end], abs=2e-3
    )
    tq.close()


def test_stop_strings_of_any_length_end_a_turn_on_both_routes_as_vllm_ends_it(
    redis_server: RedisServer,
    model_dir: Path,
    engine: EngineProcess,
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    """A ReAct agent stops each turn on "\nObservation:" and writes the observation after it
    itself. The answer leaves the stop string out (unless include_stop_str_in_output), the
    trajectory keeps every token the engine generated, and the agent's next prompt, which
    repeats the stop string, does not record it twice. Alternatives per token come from the
    engine when asked."""
    react = "Thought: add them\nAction: add\nObservation: 4"
    said = "Thought: add them\nAction: add"
    stop = "\nObservation:"
    steered = steer(re.escape(react))

    async def agent(gw: Gateway) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # completions on text, as a classic ReAct agent on a completions model
        out["react"] = react_session = await gw.open(data_source="env")
        client = gw.agent(react_session)
        prompt = "Question: what is 2 + 2?\n"
        first = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, stop=[stop], logprobs=2, extra_body=steered
        )
        follow = prompt + first.choices[0].text + stop + " 4\nThought:"
        second = await client.completions.create(
            model=MODEL, prompt=follow, max_tokens=8, extra_body=steer(re.escape(" done"))
        )
        out["completions"] = (first, second, follow[len(prompt + first.choices[0].text) :])
        # chat, the same stop, with and without the stop string in the answer
        for name, include in (("chat", False), ("chat_included", True)):
            session_id = await gw.open(data_source="env")
            chat = gw.agent(session_id)
            question = [{"role": "user", "content": "What is 2 + 2?"}]
            answer = await chat.chat.completions.create(
                model=MODEL,
                messages=question,
                max_tokens=40,
                stop=stop,
                logprobs=True,
                top_logprobs=3,
                extra_body=steered | {"include_stop_str_in_output": include},
            )
            # the reply as returned extends the conversation
            question += [answer.choices[0].message, {"role": "user", "content": "4"}]
            await chat.chat.completions.create(model=MODEL, messages=question, max_tokens=4)
            out[name] = answer
            assert (await gw.post(f"/sessions/{session_id}/close"))[0] == 200
        assert (await gw.post(f"/sessions/{react_session}/close"))[0] == 200
        return out

    tq = TransferQueue(redis_server.client())
    with gateway(redis_server, model_dir, [engine.url], tmp_path / "gw") as process:
        out = asyncio.run(agent(Gateway(process)))
    try:
        (trajectory,) = tq.get_trajectories(AGENT_PARTITION, [f"agent-{out['react']}_0"])
    finally:
        tq.close()

    first, second, added = out["completions"]
    assert (first.choices[0].text, first.choices[0].finish_reason) == (said, "stop")
    assert out["chat"].choices[0].message.content == said  # the routes agree
    assert out["chat_included"].choices[0].message.content == said + stop
    generated = first.choices[0].token_ids
    decoded = tokenizer.decode(generated, skip_special_tokens=True)
    assert decoded.startswith(said + stop)  # the engine's tokens, stop string and all
    # The trajectory: the first turn's tokens, then only what the agent added after the stop
    # string (and after whatever else the last token decoded to), then the second turn.
    held_back = decoded[len(said) :]
    assert added.startswith(held_back)
    observation = encode(tokenizer, added[len(held_back) :])
    response = list(trajectory.response_token_ids)
    assert response == generated + observation + second.choices[0].token_ids
    assert second.model_extra["prompt_token_ids"] == list(trajectory.prompt_token_ids) + (
        generated + observation
    )
    # top_logprobs: the engine's best alternatives per token, best first; the sampled token's
    # own log-prob is never above the best one's.
    for answer in (out["chat"], out["chat_included"]):
        for entry in answer.choices[0].logprobs.content:
            best = [alt.logprob for alt in entry.top_logprobs]
            assert len(best) == 3 and best == sorted(best, reverse=True), entry
            assert entry.logprob <= best[0] + 1e-6
    top = first.choices[0].logprobs.top_logprobs
    assert len(top) == len(generated) and all(1 <= len(at) <= 2 for at in top)


def test_the_responses_api_is_served_as_chat_and_recorded_the_same_way(
    redis_server: RedisServer,
    model_dir: Path,
    engine: EngineProcess,
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    """The official client's `responses.create`, as the OpenAI Agents SDK sends it: a function
    call (steered), its output fed back with the call items as returned, an answer, then a
    streamed turn after a user message. The session records one trajectory, whose turns are
    the chat template's rendering of the same conversation, and whose answers the client
    parses as `Response` objects and stream events."""
    question = "What is 2 + 2? Use the tool."
    tools = [{"type": "function", **TOOLS[0]["function"]}]

    async def agent(gw: Gateway, session_id: str) -> list[Any]:
        client = gw.agent(session_id)
        items: list[Any] = [{"role": "user", "content": question}]
        first = await client.responses.create(
            model=MODEL,
            instructions="You add numbers.",
            input=items,
            tools=tools,
            max_output_tokens=60,
            extra_body={"structured_outputs": {"regex": call_regex("add", a=2, b=2)}},
        )
        (call,) = [item for item in first.output if item.type == "function_call"]
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "4"})
        second = await client.responses.create(
            model=MODEL,
            instructions="You add numbers.",
            input=items,
            tools=tools,
            max_output_tokens=20,
            extra_body={"structured_outputs": {"regex": re.escape("Answer: 4")}},
        )
        items += [item.model_dump(exclude_none=True) for item in second.output]
        items.append({"role": "user", "content": "Thanks. Say more."})
        stream = await client.responses.create(
            model=MODEL,
            instructions="You add numbers.",
            input=items,
            tools=tools,
            max_output_tokens=8,
            stream=True,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
        )
        events = [event async for event in stream]
        return [first, second, events]

    tq = TransferQueue(redis_server.client())
    with gateway(redis_server, model_dir, [engine.url], tmp_path / "gw") as process:
        gw = Gateway(process)
        session_id = asyncio.run(gw.open(data_source="env"))
        first, second, events = asyncio.run(agent(gw, session_id))
        status, end = asyncio.run(gw.post(f"/sessions/{session_id}/close"))
    try:
        (trajectory,) = tq.get_trajectories(AGENT_PARTITION, [end["trajectory_key"]])
    finally:
        tq.close()

    assert status == 200 and end["num_turns"] == 3
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "add",
        {"a": 2, "b": 2},
    )
    assert first.status == "completed" and first.usage.output_tokens > 0
    (message,) = second.output
    assert message.type == "message" and second.output_text == "Answer: 4"
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    final = events[-1].response
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text_done = next(event for event in events if event.type == "response.output_text.done")
    assert text_done.text == final.output_text
    assert all(len(entry.top_logprobs) == 2 for entry in text_done.logprobs)
    assert len(text_done.logprobs) == final.usage.output_tokens

    # The trajectory is the chat route's record of the same conversation.
    conversation = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "add", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "4"},
        {"role": "assistant", "content": "Answer: 4"},
        {"role": "user", "content": "Thanks. Say more."},
    ]
    head = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    generated = [s for s in trajectory.spans if s.generated]
    assert len(generated) == 3 and not trajectory.tags.is_infra
    response = list(trajectory.response_token_ids)
    recorded = tokenizer.decode(list(trajectory.prompt_token_ids) + response[: generated[2].start])
    assert recorded.replace("<|endoftext|>", "") == head


# --- what agents get wrong --------------------------------------------------------------------


def test_malformed_requests_get_openai_style_errors_and_the_session_survives(
    redis_server: RedisServer,
    model_dir: Path,
    engine: EngineProcess,
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    hello = [{"role": "user", "content": "hello"}]

    async def main(gw: Gateway) -> None:
        session_id = await gw.open()
        path = f"/sessions/{session_id}/v1/chat/completions"

        async def error(path: str, body: Any, status: int, **kwargs: Any) -> dict[str, Any]:
            got, answer = await gw.post(path, body, **kwargs)
            assert got == status, answer
            assert set(answer["error"]) == {"message", "type", "param", "code"}
            assert answer["error"]["message"]
            return answer["error"]

        assert (await error(path, b"{not json", 400))["type"] == "invalid_request_error"
        assert (await error(path, {"model": MODEL}, 400))["param"] == "messages"
        assert (await error(path, {"model": MODEL, "messages": []}, 400))["param"] == "messages"
        wrong = await error(path, {"model": "gpt-4o", "messages": hello}, 404)
        assert wrong["code"] == "model_not_found" and "policy" in wrong["message"]
        too_many = {"model": MODEL, "messages": hello, "max_tokens": 100_000}
        assert (await error(path, too_many, 400))["param"] == "max_tokens"
        assert (await error(path, {"model": MODEL, "messages": hello, "n": 2}, 400))["param"] == "n"
        bad_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
        assert "role" in (await error(path, bad_role, 400))["message"]
        bad_stop = {"model": MODEL, "messages": hello, "stop": ["two words", 3]}
        assert (await error(path, bad_stop, 400))["param"] == "stop"
        unknown = await error("/sessions/nope/v1/chat/completions", {}, 404)
        assert unknown["code"] == "session_not_found"
        no_session = await error("/v1/chat/completions", {"model": MODEL, "messages": hello}, 400)
        assert "X-Relayrl-Session" in no_session["message"]
        assert (await error("/no/such/route", {}, 404))["type"] == "invalid_request_error"
        assert "unknown fields" in (await error("/sessions", {"colour": "red"}, 400))["message"]
        # the trainer's partition is not open to callers (agent_http.open_partitions)
        forbidden = await error("/sessions", {"partition": "train"}, 403)
        assert forbidden["type"] == "permission_error" and "open_partitions" in forbidden["message"]
        # a caller never sets the ground truth it is scored against, nor a malformed reward
        assert (await error("/sessions", {"ground_truth": "4"}, 400))["param"] == "ground_truth"
        close = f"/sessions/{session_id}/close"
        for bad in (
            {"env_reward": 1.0},
            {"env_reward": {"status": "great", "score": 1}},
            {"env_reward": {"status": "ok"}},
            {"env_reward": {"status": "ok", "score": float("inf")}},
            {"env_reward": {"status": "ok", "score": 1, "why": "x"}},
            {"reward": 1},
        ):
            assert (await error(close, bad, 400))["type"] == "invalid_request_error", bad

        # None of that touched the session; the header form reaches it too.
        status, answer = await gw.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": hello, "max_tokens": 4},
            headers={"X-Relayrl-Session": session_id},
        )
        assert status == 200 and answer["relayrl"]["turn"] == 0, answer
        reply = answer["choices"][0]["message"]

        # The official client sees the same errors as typed exceptions.
        client = gw.agent(session_id)
        with pytest.raises(openai.NotFoundError):
            await gw.agent("missing").chat.completions.create(model=MODEL, messages=hello)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=hello, max_tokens=10**6)
        # An agent that edits an earlier turn starts a segment of its own: the recorded
        # tokens stay what the policy saw (docs/architecture.md#segments).
        edited = [{"role": "user", "content": "HELLO"}, reply, {"role": "user", "content": "?"}]
        segment = await client.chat.completions.create(
            model=MODEL, messages=edited, max_tokens=4, extra_body={"return_token_ids": True}
        )
        rendered = tokenizer.apply_chat_template(edited, add_generation_prompt=True, tokenize=False)
        assert segment.model_extra["prompt_token_ids"] == encode(tokenizer, rendered)
        # ... while one that extends the first conversation goes on, streamed if it asks.
        extended = [*hello, reply, {"role": "user", "content": "go on"}]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=extended,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert 1 <= chunks[-1].usage.completion_tokens <= 4

        state = await gw.get(f"/sessions/{session_id}")
        assert (state["num_turns"], state["kind"], state["replica"]) == (3, "chat", "engine-0")
        assert state["num_response_tokens"] > state["num_turns"]

        status, end = await gw.post(f"/sessions/{session_id}/close")
        assert status == 200 and end["outcome"] == "finished" and end["num_turns"] == 3
        ended = await error(path, {"model": MODEL, "messages": extended}, 410)
        assert "closed" in ended["message"]
        no_model = await error(f"/sessions/{await gw.open()}/v1/completions", {"prompt": "x"}, 400)
        assert no_model["param"] == "model"

    async def completions(gw: Gateway) -> None:
        session_id = await gw.open()
        client = gw.agent(session_id)
        token_ids = {"return_token_ids": True}
        first = await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=5, extra_body=token_ids
        )
        text = first.choices[0].text
        follow = "Once upon" + text + " and then"
        second = await client.completions.create(
            model=MODEL, prompt=follow, max_tokens=5, logprobs=0, extra_body=token_ids
        )
        recorded = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        assert second.model_extra["prompt_token_ids"][: len(recorded)] == recorded
        assert len(second.choices[0].logprobs.token_logprobs) == second.usage.completion_tokens
        # a prompt that does not start with the text so far: a segment of its own
        third = await client.completions.create(
            model=MODEL, prompt="Twice upon", max_tokens=5, extra_body=token_ids
        )
        assert third.model_extra["prompt_token_ids"] == encode(tokenizer, "Twice upon")
        status, end = await gw.post(f"/sessions/{session_id}/close")
        assert status == 200 and end["num_turns"] == 3, end

    with gateway(redis_server, model_dir, [engine.url], tmp_path / "gw") as process:
        gw = Gateway(process)
        asyncio.run(main(gw))
        asyncio.run(completions(gw))
        for request, code in [
            (rollout_pb2.OpenSessionRequest(index=1), grpc.StatusCode.INVALID_ARGUMENT),
            (rollout_pb2.OpenSessionRequest(uid="g1"), grpc.StatusCode.INVALID_ARGUMENT),
            (
                rollout_pb2.OpenSessionRequest(partition="agent", uid="g1", claim_id="c1"),
                grpc.StatusCode.NOT_FOUND,  # no such group
            ),
            (
                # claim ids are sequential: a caller must not reach the trainer's partitions
                rollout_pb2.OpenSessionRequest(partition="train", uid="g1", claim_id="c1"),
                grpc.StatusCode.PERMISSION_DENIED,
            ),
            (rollout_pb2.OpenSessionRequest(partition="train"), grpc.StatusCode.PERMISSION_DENIED),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                gw.rpc(lambda stub, request=request: stub.OpenSession(request))
            assert failed.value.code() == code and failed.value.details()
        for session_id, code in [("x", "NOT_FOUND"), ("", "INVALID_ARGUMENT")]:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                gw.rpc(
                    lambda stub, sid=session_id: stub.CloseSession(
                        rollout_pb2.CloseSessionRequest(session_id=sid)
                    )
                )
            assert failed.value.code() == getattr(grpc.StatusCode, code)
        # A session still open when the gateway stops (SIGTERM) is put as failed.
        left_open = asyncio.run(gw.open())
        asyncio.run(
            gw.agent(left_open).chat.completions.create(model=MODEL, messages=hello, max_tokens=3)
        )
    tq = TransferQueue(redis_server.client())
    (trajectory,) = tq.get_trajectories(AGENT_PARTITION, [f"agent-{left_open}_0"])
    assert trajectory.tags.is_infra and trajectory.error == "the gateway shut down"
    tq.close()


# --- routing, claimed groups, abort -----------------------------------------------------------


def test_sessions_stick_to_their_replica_and_an_abort_fails_the_trajectory_as_infra(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    tq.create_partition("train")
    tq.put_groups(
        "train",
        [
            common_pb2.PromptGroup(
                uid="g1", num_samples=2, prompt_token_ids=[1, 2, 3], data_source="arith"
            )
        ],
    )
    (claim,) = tq.claim_groups("train", max_groups=1, claimer="orchestrator", lease_s=600).claimed
    # Two replicas (two names of the same engine): new sessions spread, and stay.
    urls = [engine.url, engine.url.replace("127.0.0.1", "localhost")]

    async def converse(gw: Gateway, session_id: str, turns: int) -> list[str]:
        client = gw.agent(session_id)
        messages: list[Any] = [{"role": "user", "content": f"hi from {session_id[:6]}"}]
        replicas = []
        for turn in range(turns):
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, seed=turn
            )
            replicas.append(answer.model_extra["relayrl"]["replica"])
            messages += [answer.choices[0].message, {"role": "user", "content": "more"}]
        return replicas

    # this test's own orchestrator claims on "train": that partition is opened to callers
    open_partitions = ["agent", "train"]
    with gateway(
        redis_server, model_dir, urls, tmp_path / "gw", open_partitions=open_partitions
    ) as process:
        gw = Gateway(process)
        opened = [
            gw.rpc(lambda stub: stub.OpenSession(rollout_pb2.OpenSessionRequest(data_source="x")))
            for _ in range(2)
        ]
        on_sample = gw.rpc(
            lambda stub: stub.OpenSession(
                rollout_pb2.OpenSessionRequest(
                    partition="train", uid="g1", index=1, claim_id=claim.claim_id
                )
            )
        )
        assert (on_sample.uid, on_sample.index, on_sample.partition) == ("g1", 1, "train")
        assert on_sample.base_path == f"/sessions/{on_sample.session_id}/v1"
        assert on_sample.agent_http_port == int(gw.http.rsplit(":", 1)[1])
        with pytest.raises(grpc.aio.AioRpcError) as twice:  # one session per sample
            gw.rpc(
                lambda stub: stub.OpenSession(
                    rollout_pb2.OpenSessionRequest(
                        partition="train", uid="g1", index=1, claim_id=claim.claim_id
                    )
                )
            )
        assert twice.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        async def all_sessions() -> list[list[str]]:
            # Two sessions at once: whichever asks first takes one replica, the other one the
            # other (it has fewer sessions); each stays where it started for all its turns.
            pair = await asyncio.gather(
                converse(gw, opened[0].session_id, 3), converse(gw, opened[1].session_id, 3)
            )
            return [*pair, await converse(gw, on_sample.session_id, 2)]

        first, second, third = asyncio.run(all_sessions())
        assert len(set(first)) == len(set(second)) == len(set(third)) == 1
        assert {first[0], second[0]} == {"engine-0", "engine-1"}

        aborted = gw.rpc(
            lambda stub: stub.AbortSession(
                rollout_pb2.AbortSessionRequest(
                    session_id=opened[0].session_id, reason="the agent's sandbox died"
                )
            )
        ).end
        assert aborted.outcome == rollout_pb2.SESSION_OUTCOME_FAILED
        assert aborted.reason == "the agent's sandbox died" and aborted.num_turns == 3
        closed = gw.rpc(
            lambda stub: stub.CloseSession(
                rollout_pb2.CloseSessionRequest(session_id=opened[1].session_id)
            )
        ).end
        assert closed.outcome == rollout_pb2.SESSION_OUTCOME_FINISHED
        status, sample_end = asyncio.run(gw.post(f"/sessions/{on_sample.session_id}/close"))
        assert status == 200 and sample_end["trajectory_key"] == "g1_1"
        # A session that generated nothing leaves nothing behind.
        idle_id = asyncio.run(gw.open())
        status, discarded = asyncio.run(gw.post(f"/sessions/{idle_id}/abort", {"reason": "nah"}))
        assert status == 200 and discarded["outcome"] == "discarded", discarded
        assert discarded["trajectory_key"] == ""

    (failed,) = tq.get_trajectories(AGENT_PARTITION, [aborted.trajectory_key])
    assert failed.tags.status == common_pb2.TRAJECTORY_STATUS_FAILED and failed.tags.is_infra
    assert failed.error == "the agent's sandbox died" and not failed.HasField("reward")
    assert len(failed.response_token_ids) == aborted.num_response_tokens > 0
    assert {s.replica for s in failed.spans if s.generated} == {first[0]}
    (finished,) = tq.get_trajectories(AGENT_PARTITION, [closed.trajectory_key])
    assert finished.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
    assert {s.replica for s in finished.spans if s.generated} == {second[0]}
    # The claimed group's sample went in under the orchestrator's claim; sample 0 is still
    # missing, so the group keeps running.
    (entry,) = tq.get_groups("train", ["g1"])
    assert entry.group.tags.status == common_pb2.GROUP_STATUS_RUNNING
    assert [t.index for t in entry.trajectories] == [1]
    assert entry.trajectories[0].tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED
    counts = tq.counts(AGENT_PARTITION)
    assert sum(counts.trajectories.values()) == 2  # the discarded session wrote nothing
    tq.close()


def test_an_idle_session_is_aborted_as_infra(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    idle_s = 1.5
    with gateway(
        redis_server, model_dir, [engine.url], tmp_path / "gw", session_idle_timeout_s=idle_s
    ) as process:
        gw = Gateway(process)
        session_id = asyncio.run(gw.open())

        async def one_turn() -> None:
            await gw.agent(session_id).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )

        asyncio.run(one_turn())
        key = f"agent-{session_id}_0"
        wait_until(
            lambda: tq.counts(AGENT_PARTITION).trajectories.get("failed", 0) == 1,
            30,
            "the idle session's trajectory",
        )
        with pytest.raises(openai.APIStatusError) as ended:
            asyncio.run(one_turn())
        assert ended.value.status_code == 410 and "idle" in ended.value.message
    (trajectory,) = tq.get_trajectories(AGENT_PARTITION, [key])
    assert trajectory.tags.is_infra and "idle" in trajectory.error
    tq.close()


def test_with_auth_an_agent_opens_sessions_and_each_session_answers_only_its_own_token(
    redis_server: RedisServer, model_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    tokens = {p: f"{p}-token-{'x' * 24}" for p in ("agent", "operator", "other-agent")}
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(json.dumps({p: token_digest(t) for p, t in tokens.items()}))
    auth = {
        "type": "static_token",
        "tokens_file": str(tokens_file),
        "roles": {"other-agent": ["agent"]},
    }
    process = gateway(redis_server, model_dir, [engine.url], tmp_path / "gw")
    process.config_path.write_text(
        yaml.safe_dump(yaml.safe_load(process.config_path.read_text()) | {"auth": auth})
    )

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def main(gw: Gateway) -> None:
        status, body = await gw.post("/sessions")
        assert status == 401 and body["error"]["type"] == "authentication_error", body
        status, body = await gw.post("/sessions", headers=bearer(tokens["operator"]))
        assert status == 403 and "agent role" in body["error"]["message"], body
        status, first = await gw.post("/sessions", headers=bearer(tokens["agent"]))
        assert status == 201 and first["token"], first
        status, second = await gw.post("/sessions", headers=bearer(tokens["other-agent"]))
        assert status == 201 and second["token"] not in (None, first["token"])
        one = first["session_id"]
        agent = openai.AsyncOpenAI(
            base_url=f"{gw.http}/sessions/{one}/v1", api_key=first["token"], max_retries=0
        )
        reply = await agent.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.choices[0].message is not None
        assert [m.id async for m in agent.models.list()] == [MODEL]
        for key, error in (
            ("x" * 30, openai.AuthenticationError),
            (second["token"], openai.PermissionDeniedError),
        ):
            stranger = openai.AsyncOpenAI(
                base_url=f"{gw.http}/sessions/{one}/v1", api_key=key, max_retries=0
            )
            with pytest.raises(error):
                await stranger.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
        # the opener manages its session with its own token; another agent may not
        async with aiohttp.ClientSession(trust_env=False) as http:
            async with http.get(f"{gw.http}/sessions/{one}", headers=bearer(tokens["agent"])) as r:
                assert r.status == 200
            url = f"{gw.http}/sessions/{one}/abort"
            async with http.post(url, headers=bearer(tokens["other-agent"])) as r:
                assert r.status == 403
        status, body = await gw.post(f"/sessions/{one}/close", headers=bearer(first["token"]))
        assert status == 200, body
        # a closed session's token opens nothing any more: the session is gone (410)
        with pytest.raises(openai.APIStatusError) as gone:
            await agent.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert gone.value.status_code == 410, gone.value

    with process:
        gw = Gateway(process)
        asyncio.run(main(gw))

        async def over_grpc() -> rollout_pb2.OpenSessionResponse:
            async with make_channel(
                process.target, default_timeout_s=30, bearer_token=tokens["agent"]
            ) as channel:
                return await rollout_pb2_grpc.RolloutGatewayStub(channel).OpenSession(
                    rollout_pb2.OpenSessionRequest()
                )

        opened = asyncio.run(over_grpc())
        assert opened.token

        async def state() -> int:
            async with (
                aiohttp.ClientSession(trust_env=False) as http,
                http.get(
                    f"{gw.http}/sessions/{opened.session_id}",
                    headers={"Authorization": f"Bearer {opened.token}"},
                ) as response,
            ):
                return response.status

        assert asyncio.run(state()) == 200


# --- in process: cancellation and engine failures -------------------------------------------


class ScriptedEngine(EngineClient):
    """An engine replica in process whose generate calls follow a script: "answer" (a short
    reply ending on <|im_end|>), "fail" (the engine is unreachable) or "hang" (until
    cancelled)."""

    name = "scripted"

    def __init__(self, im_end: int) -> None:
        self.script: list[str] = []
        self.hanging = asyncio.Event()
        self._im_end = im_end

    async def generate(self, request: GenerateRequest) -> Generation:
        action = self.script.pop(0)
        if action == "fail":
            raise EngineUnavailable("scripted: connection refused")
        if action == "hang":
            self.hanging.set()
            await asyncio.Event().wait()
        tokens = (70, 71, 72, self._im_end)
        return Generation(
            request.request_id, tokens, (-0.5,) * 4, "stop", (VersionSpan("3", 0, 4),)
        )

    async def health(self) -> bool:
        return True

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool:
        return False

    async def reset_prefix_cache(self) -> None: ...

    async def weight_version(self) -> str:
        return "3"

    async def set_weight_version(self, version: str) -> None: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def worker_rpc(self, method: str, payload: dict[str, Any]) -> list[Any]:
        return []

    async def close(self) -> None: ...


def test_an_abort_cancels_the_request_in_flight_and_engine_failures_keep_the_session(
    redis_server: RedisServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    hello = [{"role": "user", "content": "hello"}]

    def chat(messages: list[dict[str, Any]]) -> ChatRequest:
        return ChatRequest(messages, None, TurnSampling(max_tokens=8))

    async def main(tq: AsyncTransferQueue) -> None:
        # health checks: the failure takes the replica out until its next check
        pool, engine, sessions = await scripted_sessions(tq, tokenizer, health_checks=True)
        # A caller may not open ad-hoc sessions unless agent_http.adhoc_sessions says so.
        with pytest.raises(AgentError) as adhoc:
            await sessions.open_for_caller(SessionSpec(data_source="x"))
        assert adhoc.value.kind is ErrorKind.FORBIDDEN and "adhoc_sessions" in str(adhoc.value)
        # A pending group ahead of the session's stays pending: put-and-claim takes only its own.
        await tq.put_groups(
            AGENT_PARTITION,
            [common_pb2.PromptGroup(uid="aaa", num_samples=1, prompt_token_ids=[1])],
        )
        session_id = (await sessions.open(SessionSpec(data_source="x"))).session_id
        engine.script = ["fail", "answer", "hang"]

        with pytest.raises(AgentError) as failed:
            await sessions.chat(session_id, chat(hello))
        assert failed.value.kind is ErrorKind.ENGINE and "connection refused" in str(failed.value)
        assert sessions.get(session_id).num_turns == 0  # nothing recorded; retry
        first = await sessions.chat(session_id, chat(hello))
        assert first.content == tokenizer.decode([70, 71, 72])
        (passed,) = await tq.get_groups(AGENT_PARTITION, ["aaa"], with_trajectories=False)
        assert passed.group.tags.status == common_pb2.GROUP_STATUS_PENDING

        follow_up = [*hello, {"role": "assistant", "content": first.content}]
        follow_up.append({"role": "user", "content": "more"})
        in_flight = asyncio.create_task(sessions.chat(session_id, chat(follow_up)))
        await engine.hanging.wait()
        with pytest.raises(AgentError) as busy:
            await sessions.chat(session_id, chat(follow_up))
        assert busy.value.code == "request_in_flight"
        end = await sessions.abort(session_id, "the agent's container was evicted")
        assert (end.outcome, end.num_turns) == ("failed", 1)
        with pytest.raises(AgentError) as cut:
            await in_flight
        assert cut.value.kind is ErrorKind.ENDED and "evicted" in str(cut.value)
        (trajectory,) = await tq.get_trajectories(AGENT_PARTITION, [end.trajectory_key])
        assert trajectory.tags.is_infra and trajectory.error == "the agent's container was evicted"
        assert list(trajectory.response_token_ids) == [70, 71, 72, engine._im_end]
        (span,) = trajectory.spans
        assert (span.policy_version, span.replica, span.turn) == (3, "engine-0", 0)
        await sessions.close()
        await pool.close()

    run_with_async_queue(redis_server, main)


def test_an_agent_that_exits_ends_its_session_as_a_close_unless_the_infrastructure_failed(
    redis_server: RedisServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    """What `end_on_exit` makes of a session whose agent exited 0 without closing it: a close
    (no environment reward) after an answered request, also when an earlier failure was
    retried; the infrastructure's failure after a last request that failed on our side, with
    a request still in flight, or with nothing generated."""
    hello = [{"role": "user", "content": "hello"}]
    who = "agent 'a' exited 0"

    def chat(messages: list[dict[str, Any]]) -> ChatRequest:
        return ChatRequest(messages, None, TurnSampling(max_tokens=8))

    async def main(tq: AsyncTransferQueue) -> None:
        pool, engine, sessions = await scripted_sessions(tq, tokenizer, health_checks=True)

        async def session(script: list[str]) -> str:
            session_id = (await sessions.open(SessionSpec(data_source="x"))).session_id
            engine.script = list(script)
            return session_id

        async def turns(session_id: str, count: int) -> None:
            messages = list(hello)
            for _ in range(count):
                with contextlib.suppress(AgentError):
                    answer = await sessions.chat(session_id, chat(messages))
                    messages += [{"role": "assistant", "content": answer.content}]
                    messages += [{"role": "user", "content": "more"}]

        answered = await session(["answer"])
        await turns(answered, 1)
        retried = await session(["fail", "answer"])
        await turns(retried, 2)
        failed_last = await session(["answer", "fail"])
        await turns(failed_last, 2)
        nothing = await session([])
        ends = {
            name: await sessions.end_on_exit(session_id, who)
            for name, session_id in (
                ("answered", answered),
                ("retried", retried),
                ("failed_last", failed_last),
                ("nothing", nothing),
            )
        }
        in_flight_id = await session(["answer", "hang"])
        request = asyncio.create_task(turns(in_flight_id, 2))
        await engine.hanging.wait()
        ends["in_flight"] = await sessions.end_on_exit(in_flight_id, who)
        await request

        outcomes = {name: end.outcome for name, end in ends.items()}
        assert outcomes == {
            "answered": "finished",
            "retried": "finished",
            "failed_last": "failed",
            "nothing": "discarded",
            "in_flight": "failed",
        }
        assert ends["failed_last"].reason.startswith(f"{who} after its last request failed: ")
        assert "connection refused" in ends["failed_last"].reason
        assert ends["nothing"].reason == f"{who} with no generation"
        assert ends["in_flight"].reason == f"{who} while its request was still being answered"
        keys = [ends[name].trajectory_key for name in ("answered", "failed_last", "in_flight")]
        finished, failed, cut = await tq.get_trajectories(AGENT_PARTITION, keys)
        assert not finished.tags.is_infra and not finished.error
        assert not finished.HasField("env_reward")  # a close without the environment's reward
        assert failed.tags.is_infra and "connection refused" in failed.error
        # what was answered before the request in flight stays on record
        assert cut.tags.is_infra and list(cut.response_token_ids) == [70, 71, 72, engine._im_end]
        await sessions.close()
        await pool.close()

    run_with_async_queue(redis_server, main)


def test_only_a_close_sets_the_environment_reward_and_labels_stay_labels(
    redis_server: RedisServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The close's reward is the trajectory's `env_reward` field; labels of the reward's old
    names, opened with, are carried as labels and never become a reward."""
    from relayrl.core.env_reward import EnvReward

    hello = [{"role": "user", "content": "hello"}]
    posing = {"env_reward": "1.0", "env_reward_status": "ok", "task": "t"}

    async def main(tq: AsyncTransferQueue) -> None:
        pool, engine, sessions = await scripted_sessions(tq, tokenizer)
        keys = []
        for reward in (EnvReward("fail", 0.25, "2 of 8 checks"), None):
            session_id = (
                await sessions.open(SessionSpec(data_source="env", labels=posing))
            ).session_id
            engine.script = ["answer"]
            await sessions.chat(session_id, ChatRequest(hello, None, TurnSampling(max_tokens=8)))
            end = await sessions.close_session(session_id, env_reward=reward)
            assert end.outcome == "finished", end
            keys.append(end.trajectory_key)
        reported, silent = await tq.get_trajectories(AGENT_PARTITION, keys)
        assert reported.env_reward == common_pb2.EnvReward(
            status=common_pb2.ENV_REWARD_STATUS_FAIL, score=0.25, message="2 of 8 checks"
        )
        assert not silent.HasField("env_reward")
        for trajectory in (reported, silent):
            assert {k: trajectory.labels[k] for k in posing} == posing
        await sessions.close()
        await pool.close()

    run_with_async_queue(redis_server, main)


def test_a_request_that_extends_no_conversation_starts_a_segment_of_the_same_sample(
    redis_server: RedisServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Changed tools and a rewritten history start segments, each rendered from its own
    request; a request that extends an earlier conversation continues that one. The
    trajectory's own fields are the segment that generated last, the others ride along in
    the order they started; with segments off, such a request is refused."""
    hello = [{"role": "user", "content": "hello"}]

    def chat(messages: list[dict[str, Any]], tools: Any = None) -> ChatRequest:
        return ChatRequest(messages, tools, TurnSampling(max_tokens=8))

    async def main(tq: AsyncTransferQueue) -> None:
        pool = ReplicaPool(health_interval_s=0.1)
        engine = ScriptedEngine(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        await pool.add("engine-0", engine)
        engine.script = ["answer"] * 5

        def sessions_with(**config: Any) -> AgentSessions:
            return AgentSessions(
                tq=tq,
                pool=pool,
                tokenizer=tokenizer,
                config=AgentHttpConfig(**config),
                claimer="test",
                lease_s=60,
                request_timeout_s=10,
            )

        sessions = sessions_with()
        await sessions.start()
        session_id = (await sessions.open(SessionSpec(data_source="x"))).session_id
        first = await sessions.chat(session_id, chat(hello))
        reply = {"role": "assistant", "content": first.content}
        # the agent binds tools from here on: not an extension, a new segment
        with_tools = await sessions.chat(
            session_id, chat([*hello, reply, {"role": "user", "content": "add"}], TOOLS)
        )
        # a summarised history: another new segment
        summary = await sessions.chat(session_id, chat([{"role": "user", "content": "sum: hi"}]))
        # the first conversation goes on: its segment continues
        again = await sessions.chat(
            session_id, chat([*hello, reply, {"role": "user", "content": "again"}])
        )
        end = await sessions.close_session(session_id)
        (trajectory,) = await tq.get_trajectories(AGENT_PARTITION, [end.trajectory_key])

        assert [r.turn for r in (first, with_tools, summary, again)] == [0, 1, 2, 3]
        assert (end.outcome, end.num_turns) == ("finished", 4)
        generated = [70, 71, 72, engine._im_end]

        def rendered(messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
            return encode(tokenizer, text)

        new_turn = [*hello, reply, {"role": "user", "content": "add"}]
        assert list(with_tools.prompt_token_ids) == rendered(new_turn, TOOLS)
        assert list(summary.prompt_token_ids) == rendered([{"role": "user", "content": "sum: hi"}])
        assert again.prompt_token_ids[: len(first.prompt_token_ids) + 4] == (
            first.prompt_token_ids + tuple(generated)
        )
        # its own fields: the first conversation (which generated last), both turns
        assert list(trajectory.prompt_token_ids) == list(first.prompt_token_ids)
        response = list(trajectory.response_token_ids)
        assert response[:4] == generated and response[-4:] == generated
        assert [s.turn for s in trajectory.spans if s.generated] == [0, 1]
        # the others, in the order they started, each a whole conversation of its own
        assert [list(s.prompt_token_ids) for s in trajectory.segments] == [
            list(with_tools.prompt_token_ids),
            list(summary.prompt_token_ids),
        ]
        for segment in trajectory.segments:
            assert list(segment.response_token_ids) == generated
            assert bytes(segment.response_mask) == b"\x01" * 4
            assert list(segment.rollout_logprobs) == [-0.5] * 4
        assert not trajectory.tags.is_infra and trajectory.tags.max_policy_version == 3
        await sessions.close()

        # with segments off, the same change is refused and the session stays
        strict = sessions_with(segments=False)
        await strict.start()
        engine.script = ["answer"]
        session_id = (await strict.open(SessionSpec(data_source="x"))).session_id
        first = await strict.chat(session_id, chat(hello))
        reply = {"role": "assistant", "content": first.content}
        with pytest.raises(AgentError) as refused:
            await strict.chat(session_id, chat([*hello, reply, {"role": "user", "x": 1}], TOOLS))
        assert refused.value.code == "conversation_diverged"
        assert "tools differ" in refused.value.message
        await strict.close()
        await pool.close()

    run_with_async_queue(redis_server, main)
