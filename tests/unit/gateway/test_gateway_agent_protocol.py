"""The agent endpoint's JSON and HTTP side without an engine or a TransferQueue: request bodies
become the session service's requests or OpenAI-style errors naming the parameter, answers have
the shape OpenAI clients read, and the router maps every failure to its status code. The
session service is a stand-in that answers from a fixed turn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from relayrl.gateway.agent_http import (
    AgentError,
    AgentHttpServer,
    ChatRequest,
    CompletionRequest,
    ErrorKind,
    SessionEnd,
    SessionSpec,
    TurnResult,
    TurnSampling,
)
from relayrl.gateway.agent_http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionResponse,
    CompletionsRequest,
    OpenSessionRequest,
    parse,
)
from relayrl.gateway.agent_http.protocol.responses import ResponseObject, ResponsesRequest
from relayrl.gateway.config import AgentHttpConfig

MODEL = "policy"
HELLO = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, **fields}


def refusal(model: type, body: dict[str, Any]) -> AgentError:
    with pytest.raises(AgentError) as refused:
        parse(model, body, MODEL)
    return refused.value


# --- requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": HELLO}, "model", "name the model"),
        (chat(messages=[]), "messages", "non-empty list"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages", "role must be one of"),
        (chat(messages=[{"role": "user"}]), "messages", "content is missing"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages", "text"),
        (chat(tool_choice="any"), "tool_choice", "'required'"),
        (chat(tools=[{"type": "function", "function": {}}]), "tools", "name is missing"),
        (chat(n=2), "n", "one choice per request"),
        (chat(presence_penalty=0.5), "presence_penalty", "not supported"),
        (chat(logit_bias={"1": 5}), "logit_bias", "structured_outputs"),
        (chat(max_tokens=0), "max_tokens", "must be in [1, 1e+09], got 0"),
        (chat(max_tokens=True), "max_tokens", "must be an integer, got True"),
        (chat(temperature="0.5"), "temperature", "must be a number, got '0.5'"),
        (chat(top_p=0), "top_p", "must be in"),
        (chat(stop=[""]), "stop", "a string or a list of strings"),
        (chat(structured_outputs={"bogus": 1}), "structured_outputs", "unknown keys ['bogus']"),
        (chat(response_format={"type": "xml"}), "response_format", "json_schema"),
        (
            chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
            "response_format",
            "not both",
        ),
        (chat(stream=1), "stream", "true or false"),
        (chat(top_logprobs=3), "top_logprobs", "needs logprobs: true"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "must be in [0, 20]"),
    ],
)
def test_a_malformed_chat_request_is_refused_naming_the_parameter(
    body: dict[str, Any], param: str, says: str
) -> None:
    refused = refusal(ChatCompletionRequest, body)
    assert (refused.kind, refused.param) == (ErrorKind.INVALID, param)
    assert says in refused.message


def test_another_model_is_not_found_and_the_first_wrong_field_is_reported() -> None:
    wrong = refusal(ChatCompletionRequest, chat(model="gpt-4o"))
    assert (wrong.kind, wrong.code) == (ErrorKind.NOT_FOUND, "model_not_found")
    assert "'policy'" in wrong.message
    # Fields are checked in a fixed order: n comes before temperature.
    assert refusal(ChatCompletionRequest, chat(temperature=3, n=2)).param == "n"


def test_a_chat_request_becomes_the_canonical_conversation() -> None:
    body = chat(
        messages=[
            {
                "role": "developer",
                "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            },
            {"role": "user", "content": "add", "name": "ann", "extra": 1},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "function": {"name": "add", "arguments": '{"b": 2,  "a": 1}'}}
                ],
            },
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
        ],
        tool_choice="none",
        max_tokens=7,
        max_completion_tokens=5,
        top_k=0,
        seed=3,
        stop="</tool_call>",
        include_stop_str_in_output=True,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        user="ignored by the gateway",
    )
    request = parse(ChatCompletionRequest, body, MODEL).to_domain()
    assert request == ChatRequest(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "add", "name": "ann"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'},
                        "id": "c1",
                    }
                ],
            },
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
        ],
        tools=None,
        sampling=TurnSampling(
            max_tokens=5,
            seed=3,
            stop=("</tool_call>",),
            include_stop_str_in_output=True,
            top_logprobs=2,
            structured_outputs={"json": {"type": "object"}},
        ),
        parse_tool_calls=False,
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Once", ("Once", None)),
        (["Once"], ("Once", None)),
        ([[1, 2]], (None, (1, 2))),
        ([0], (None, (0,))),
    ],
)
def test_a_completions_prompt_is_text_or_token_ids(prompt: Any, expected: tuple[Any, Any]) -> None:
    request = parse(CompletionsRequest, {"model": MODEL, "prompt": prompt}, MODEL).to_domain()
    assert request == CompletionRequest(*expected, TurnSampling())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ({"model": MODEL, "prompt": [1, True]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x", "suffix": "!"}, "suffix"),
        ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
    ],
)
def test_a_malformed_completions_request_is_refused(body: dict[str, Any], param: str) -> None:
    assert refusal(CompletionsRequest, body).param == param


SHARED_SAMPLING_FIELDS = [
    "n", "best_of", "presence_penalty", "frequency_penalty", "logit_bias",
    "max_completion_tokens", "max_tokens", "top_k", "temperature", "top_p", "seed", "stop",
    "include_stop_str_in_output", "structured_outputs", "response_format", "stream",
    "stream_options",
]  # fmt: skip


def test_both_routes_check_the_shared_sampling_fields_between_their_own() -> None:
    """The fields chat and completions share are declared once (`SamplingRequest`); each route
    still checks its prompt first and its log-prob fields after them."""
    assert list(ChatCompletionRequest.model_fields) == [
        "model", "messages", "tool_choice", "tools",
        *SHARED_SAMPLING_FIELDS,
        "logprobs", "top_logprobs", "return_token_ids",
    ]  # fmt: skip
    assert list(CompletionsRequest.model_fields) == [
        "model", "echo", "suffix", "prompt",
        *SHARED_SAMPLING_FIELDS,
        "logprobs", "return_token_ids",
    ]  # fmt: skip
    assert refusal(ChatCompletionRequest, chat(messages="x", n=2)).param == "messages"
    assert refusal(ChatCompletionRequest, chat(n=2, logprobs=3)).param == "n"
    completion = {"model": MODEL, "prompt": [], "n": 2, "logprobs": 9}
    assert refusal(CompletionsRequest, completion).param == "prompt"
    assert refusal(CompletionsRequest, {**completion, "prompt": "x"}).param == "n"
    assert refusal(CompletionsRequest, {"model": MODEL, "prompt": "x", "logprobs": 9}).param == (
        "logprobs"
    )


def test_an_open_session_request_takes_only_the_gateway_fields() -> None:
    unknown = refusal(OpenSessionRequest, {"colour": "red"})
    assert unknown.param is None
    assert unknown.message.startswith("unknown fields ['colour']; known: claim_id, data_source")
    assert refusal(OpenSessionRequest, {"labels": {"a": 1}}).param == "labels"
    assert refusal(OpenSessionRequest, {"index": -1}).param == "index"
    spec = parse(OpenSessionRequest, {"uid": "g1", "index": None, "labels": None}).to_domain()
    assert spec == SessionSpec(uid="g1")


# --- answers -----------------------------------------------------------------------------------


def turn(**changes: Any) -> TurnResult:
    fields: dict[str, Any] = {
        "session_id": "s1",
        "turn": 2,
        "created": 100,
        "prompt_token_ids": (1, 2, 3),
        "token_ids": (7, 8),
        "logprobs": (-0.5, -0.25),
        "text": "ab",
        "finish_reason": "stop",
        "replica_id": "engine-0",
        "version_spans": ((3, 0, 2),),
        "content": "ab",
    }
    return TurnResult(**(fields | changes))


def letters(token_ids: Sequence[int]) -> list[str]:
    return [chr(ord("a") + token_id - 7) for token_id in token_ids]


def options(body: dict[str, Any]) -> Any:
    return parse(ChatCompletionRequest, chat(**body), MODEL).options()


def test_a_chat_answer_has_openai_shape_and_the_relayrl_object() -> None:
    answer = ChatCompletionResponse.of(turn(), MODEL, options({}), letters).model_dump()
    assert answer == {
        "id": "chatcmpl-s1-2",
        "object": "chat.completion",
        "created": 100,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ab"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "relayrl": {
            "session_id": "s1",
            "turn": 2,
            "replica": "engine-0",
            "weight_versions": [{"version": 3, "start": 0, "end": 2}],
        },
    }


def test_a_streamed_chat_answer_is_the_message_then_the_finish_then_the_usage() -> None:
    call = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    result = turn(content=None, tool_calls=(call,), finish_reason="tool_calls")
    asked = options({"stream": True, "stream_options": {"include_usage": True}, "logprobs": True})
    answer = ChatCompletionResponse.of(result, MODEL, asked, letters)
    first, finish, usage = (chunk.model_dump() for chunk in answer.chunks(asked))
    assert first["object"] == "chat.completion.chunk" and "relayrl" in first
    (choice,) = first["choices"]
    assert choice["delta"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"index": 0, **call}],
    }
    assert choice["finish_reason"] is None
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["a", "b"]
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]
    assert "relayrl" not in finish and "usage" not in finish
    assert (usage["choices"], usage["usage"]["total_tokens"]) == ([], 5)


def test_a_completion_answer_carries_token_ids_and_logprobs_when_asked() -> None:
    body = {"model": MODEL, "prompt": "x", "logprobs": 0, "return_token_ids": True}
    asked = parse(CompletionsRequest, body, MODEL).options()
    answer = CompletionResponse.of(turn(), MODEL, asked, letters).model_dump()
    (choice,) = answer["choices"]
    assert (choice["text"], choice["token_ids"], answer["prompt_token_ids"]) == (
        "ab",
        [7, 8],
        [1, 2, 3],
    )
    assert choice["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": None,
        "text_offset": [0, 1],
    }


# Per token, the engine's alternatives as (token id, log-prob), best first.
ALTERNATIVES = (((7, -0.5), (9, -1.5)), ((10, -0.1), (8, -0.25)))


def test_top_logprobs_are_the_engines_alternatives_on_both_routes() -> None:
    result = turn(top_logprobs=ALTERNATIVES)
    asked = options({"logprobs": True, "top_logprobs": 2})
    (choice,) = ChatCompletionResponse.of(result, MODEL, asked, letters).model_dump()["choices"]
    content = choice["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in content] == [("a", -0.5), ("b", -0.25)]
    assert [
        [(a["token"], a["logprob"], a["bytes"]) for a in t["top_logprobs"]] for t in content
    ] == [
        [("a", -0.5, [97]), ("c", -1.5, [99])],
        [("d", -0.1, [100]), ("b", -0.25, [98])],
    ]
    body = {"model": MODEL, "prompt": "x", "logprobs": 2}
    asked = parse(CompletionsRequest, body, MODEL).options()
    (choice,) = CompletionResponse.of(result, MODEL, asked, letters).model_dump()["choices"]
    assert choice["logprobs"]["top_logprobs"] == [{"a": -0.5, "c": -1.5}, {"d": -0.1, "b": -0.25}]
    # logprobs without top_logprobs: the sampled tokens' log-probs and no alternatives
    plain = ChatCompletionResponse.of(result, MODEL, options({"logprobs": True}), letters)
    assert [t.top_logprobs for t in plain.choices[0].logprobs.content] == [[], []]


# --- the router --------------------------------------------------------------------------------


class Session:
    session_id, partition, uid, index = "s1", "agent", "agent-s1", 0


class StandInSessions:
    """Answers every turn with `turn()`; raises what `failure` names."""

    class Tokenizer:
        def decode(self, token_ids: list[int]) -> str:
            return "".join(letters(token_ids))

    tokenizer = Tokenizer()

    def __init__(self) -> None:
        self.failure: AgentError | None = None
        self.requests: list[Any] = []

    def get(self, session_id: str) -> Session:
        if session_id != "s1":
            raise AgentError(ErrorKind.NOT_FOUND, "unknown session", code="session_not_found")
        return Session()

    async def chat(self, session_id: str, request: ChatRequest) -> TurnResult:
        self.requests.append(request)
        if self.failure is not None:
            raise self.failure
        return turn()

    async def abort(self, session_id: str, reason: str) -> SessionEnd:
        self.get(session_id)
        return SessionEnd(session_id, "failed", "agent-s1_0", 1, 3, 2, reason)


def test_the_router_answers_every_failure_in_openai_shape_with_its_status() -> None:
    sessions = StandInSessions()
    server = AgentHttpServer(sessions, AgentHttpConfig(model_name=MODEL, max_request_bytes=2048))  # type: ignore[arg-type]
    path = "/sessions/s1/v1/chat/completions"

    async def main() -> list[tuple[int, Any]]:
        answers = []
        async with TestClient(TestServer(server.application())) as client:

            async def post(path: str, data: Any, **kwargs: Any) -> None:
                raw = data if isinstance(data, bytes) else json.dumps(data)
                async with client.post(path, data=raw, **kwargs) as response:
                    answers.append((response.status, await response.json()))

            await post(path, chat(max_tokens=3))
            await post(path, b"{not json")
            await post(path, b"[1]")
            await post(path, chat(n=2))
            await post("/sessions/nope/v1/chat/completions", chat())
            await post("/v1/chat/completions", chat(), headers={"X-Relayrl-Session": "other"})
            await post(path, chat(), headers={"X-Relayrl-Session": "other"})
            await post(path, b"x" * 4096)
            await post("/no/such/route", {})
            await post("/sessions/s1/abort", b"")
            for kind in ErrorKind:
                sessions.failure = AgentError(kind, f"{kind.name} happened", code="why")
                await post(path, chat())
            sessions.failure = None
            async with client.get(path) as response:
                answers.append((response.status, await response.json()))
        return answers

    answers = asyncio.run(main())
    statuses = [status for status, _ in answers]
    assert statuses == [
        200,
        400,
        400,
        400,
        404,
        404,
        400,
        413,
        404,
        200,
        400,
        404,
        409,
        410,
        429,
        403,
        502,
        503,
        405,
    ]
    for _, body in answers[1:9] + answers[10:]:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert answers[0][1]["choices"][0]["message"]["content"] == "ab"
    assert sessions.requests[0].sampling.max_tokens == 3
    assert answers[3][1]["error"]["param"] == "n"
    assert answers[4][1]["error"]["code"] == "session_not_found"
    assert "X-Relayrl-Session names other" in answers[6][1]["error"]["message"]
    assert answers[9][1]["reason"] == ""  # an empty abort body: no reason given
    assert [body["error"]["type"] for _, body in answers[10:18]] == [k.value for k in ErrorKind]


def test_tools_reach_the_template_as_name_description_and_parameters_only() -> None:
    """An SDK that adds `strict` (the OpenAI Agents SDK does) gets the prompt a plain client
    gets: `strict` is a request to the API server, not part of what the model reads."""
    function = {"name": "lookup", "description": "Look up a key.", "parameters": {"type": "object"}}
    plain_tool = {"type": "function", "function": function}
    plain = parse(ChatCompletionRequest, chat(tools=[plain_tool]), MODEL)
    sdk_tool = {"type": "function", "function": {**function, "strict": False}}
    sdk = parse(ChatCompletionRequest, chat(tools=[sdk_tool]), MODEL)
    assert (
        sdk.to_domain().tools
        == plain.to_domain().tools
        == [{"type": "function", "function": function}]
    )


# --- the Responses API ---------------------------------------------------------------------


def test_responses_input_items_become_the_chat_conversation_the_gateway_returned() -> None:
    """The Agents SDK's items: a message with output_text parts and the function calls after
    it are one assistant turn; a function_call_output is the tool's message."""
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":1}'}
    body = {
        "model": MODEL,
        "instructions": "Add.",
        "input": [
            {"role": "user", "content": "1 + 0?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}],
                "status": "completed",
                "id": "msg_1",
            },
            call | {"id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {}, "strict": True}],
        "max_output_tokens": 9,
        "text": {"format": {"type": "json_object"}},
    }
    request = parse(ResponsesRequest, body, MODEL).to_domain()
    tool_call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    assert request == ChatRequest(
        messages=[
            {"role": "system", "content": "Add."},
            {"role": "user", "content": "1 + 0?"},
            {
                "role": "assistant",
                "content": "Let me add.",
                "tool_calls": [tool_call | {"id": "c1"}],
            },
            {"role": "tool", "content": "1", "tool_call_id": "c1"},
        ],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}],
        sampling=TurnSampling(max_tokens=9, structured_outputs={"json_object": True}),
    )
    # a call with no text before it is an assistant turn of its own
    alone = parse(ResponsesRequest, {"model": MODEL, "input": [call]}, MODEL).to_domain()
    assert alone.messages == [
        {"role": "assistant", "content": "", "tool_calls": [tool_call | {"id": "c1"}]}
    ]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "non-empty"),
        ({"input": "x", "previous_response_id": "r1"}, "previous_response_id", "keeps no"),
        ({"input": [{"type": "reasoning"}]}, "input", "'reasoning' are not served"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools", "only function tools"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text", "json_schema"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice", "'required'"),
    ],
)
def test_a_malformed_responses_request_is_refused_naming_the_parameter(
    body: dict[str, Any], param: str, says: str
) -> None:
    refused = refusal(ResponsesRequest, {"model": MODEL, **body})
    assert refused.param == param and says in refused.message


def test_a_response_is_the_reply_and_its_calls_as_output_items_and_streams_as_events() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    result = turn(content="ab", tool_calls=(call,), finish_reason="tool_calls")
    request = parse(ResponsesRequest, {"model": MODEL, "input": "x"}, MODEL)
    response = ResponseObject.of(result, MODEL, request, letters)
    answer = response.model_dump()
    assert answer["object"] == "response" and answer["status"] == "completed"
    message, function_call = answer["output"]
    assert message["content"][0]["text"] == "ab" and message["role"] == "assistant"
    assert (function_call["call_id"], function_call["name"]) == ("c1", "f")
    assert answer["usage"]["input_tokens"] == 3 and answer["usage"]["output_tokens"] == 2
    events = list(response.events())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    assert events[-1]["response"] == answer
    # a reply cut by its budget is incomplete
    cut = ResponseObject.of(turn(finish_reason="length"), MODEL, request, letters)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert list(cut.events())[-1]["type"] == "response.incomplete"


def test_a_forced_tool_call_is_a_grammar_of_the_policys_tool_call_form() -> None:
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {}}}
        for name in ("add", "lookup")
    ]

    def domain(**fields: Any) -> ChatRequest:
        return parse(ChatCompletionRequest, chat(tools=tools, **fields), MODEL).to_domain()

    required = domain(tool_choice="required").sampling.structured_outputs
    assert required is not None and set(required) == {"grammar"}
    assert 'name ::= "\\"add\\"" | "\\"lookup\\""' in required["grammar"]
    named = domain(tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert 'name ::= "\\"lookup\\""\n' in named.sampling.structured_outputs["grammar"]
    # the Responses API names the function without nesting it
    body = {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "add"}]}
    body["tool_choice"] = {"type": "function", "name": "add"}
    responses = parse(ResponsesRequest, body, MODEL).to_domain()
    assert 'name ::= "\\"add\\""\n' in responses.sampling.structured_outputs["grammar"]
    for fields, says in [
        ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "not among"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
    ]:
        with pytest.raises(AgentError) as refused:
            domain(**fields)
        assert refused.value.param == "tool_choice" and says in refused.value.message
    with pytest.raises(AgentError) as no_tools:
        parse(ChatCompletionRequest, chat(tool_choice="required"), MODEL).to_domain()
    assert "needs tools" in no_tools.value.message
