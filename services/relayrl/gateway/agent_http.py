"""The OpenAI-compatible HTTP endpoint for black-box agents (003 §5.3): JSON in and out, the
session logic lives in `relayrl.gateway.sessions`.

    POST /sessions                                   open a session -> {"session_id", ...}
    GET  /sessions/{id}                              its state
    POST /sessions/{id}/close                        put the trajectory (finished)
    POST /sessions/{id}/abort      {"reason": ...}   put it as failed (is_infra), or discard it
    POST /sessions/{id}/v1/chat/completions          OpenAI chat completions
    POST /sessions/{id}/v1/completions               OpenAI (legacy) completions
    GET  /sessions/{id}/v1/models                    the one model served
    POST /v1/chat/completions, /v1/completions       the same, session in `X-Relayrl-Session`

An agent points any OpenAI client at `http://<gateway>:<port>/sessions/<id>/v1`. Beyond the
OpenAI request fields the endpoint takes vLLM's `top_k`, `structured_outputs` (e.g.
`{"regex": ...}`, passed to the engine: agents steer tool calls with it) and
`return_token_ids` (the answer then carries `prompt_token_ids` and the choice's `token_ids`);
`response_format` json_schema / json_object become structured outputs too. Every answer has a
`relayrl` object: session, turn, replica, weight-version spans.

Not supported, answered 400 with the reason: n > 1, best_of, echo, suffix, penalties,
logit_bias, top log-probs, non-text content parts, multi-token stop strings, tool_choice
"required" or a named function. `stream: true` is served as server-sent events once the turn
is generated (one content chunk, then the finish chunk), not token by token.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 bad input,
404 unknown session or model, 409 the request does not extend the conversation (or one is
already in flight), 410 the session has ended, 413 body too large, 429 too many sessions,
502 engine failure, 503 no replica serving or the TransferQueue unreachable. After a 502 or
503 the session is unchanged and the same request may be sent again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from relayrl.gateway.config import AgentHttpConfig
from relayrl.gateway.sessions import (
    AgentError,
    AgentSessions,
    ChatRequest,
    CompletionRequest,
    ErrorKind,
    SessionEnd,
    SessionSpec,
    TurnResult,
    TurnSampling,
)

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Relayrl-Session"
HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.ENDED: 410,
    ErrorKind.TOO_MANY: 429,
    ErrorKind.ENGINE: 502,
    ErrorKind.UNAVAILABLE: 503,
}
ROLES = ("system", "developer", "user", "assistant", "tool")
STRUCTURED_OUTPUT_KEYS = frozenset(
    {
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
    }
)
SPEC_FIELDS = frozenset(SessionSpec.__dataclass_fields__)


def invalid(message: str, param: str | None = None) -> AgentError:
    return AgentError(ErrorKind.INVALID, message, param=param)


# --- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerOptions:
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False


def _typed(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python, never in JSON's eyes.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise invalid(f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, kind):
        raise invalid(f"{name} must be {what}, got {value!r}", name)
    return value


def _number(
    body: Mapping[str, Any], name: str, low: float, high: float, *, integer: bool = False
) -> Any:
    kind: type | tuple[type, ...] = int if integer else (int, float)
    value = _typed(body, name, kind, "an integer" if integer else "a number")
    if value is not None and not low <= value <= high:
        raise invalid(f"{name} must be in [{low:g}, {high:g}], got {value}", name)
    return value


def check_model(body: Mapping[str, Any], model_name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: name the model (this gateway serves one)", "model")
    if model != model_name:
        raise AgentError(
            ErrorKind.NOT_FOUND,
            f"the model {model!r} does not exist; this gateway serves {model_name!r}",
            param="model",
            code="model_not_found",
        )


def _unsupported(body: Mapping[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise invalid("n: one choice per request (a session is one trajectory)", "n")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of is not supported", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise invalid(f"{name} is not supported (it changes the policy's distribution)", name)
    if body.get("logit_bias"):
        raise invalid("logit_bias is not supported; steer with structured_outputs", "logit_bias")


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    return tuple(stops)


def _structured_outputs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    given = _typed(body, "structured_outputs", dict, "an object such as {'regex': ...}")
    response_format = _typed(body, "response_format", dict, "an object")
    if response_format is not None and response_format.get("type") not in (None, "text"):
        if given is not None:
            raise invalid("set response_format or structured_outputs, not both", "response_format")
        kind = response_format.get("type")
        if kind == "json_object":
            return {"json_object": True}
        schema = (response_format.get("json_schema") or {}).get("schema")
        if kind != "json_schema" or not isinstance(schema, dict):
            raise invalid(
                "response_format: use {'type': 'json_schema', 'json_schema': {'schema': {...}}}, "
                "{'type': 'json_object'} or {'type': 'text'}",
                "response_format",
            )
        return {"json": schema}
    if given is None:
        return None
    unknown = sorted(set(given) - STRUCTURED_OUTPUT_KEYS)
    if unknown or not given:
        raise invalid(
            f"structured_outputs: unknown keys {unknown}; use one of "
            f"{', '.join(sorted(STRUCTURED_OUTPUT_KEYS))}",
            "structured_outputs",
        )
    return given


def parse_sampling(body: Mapping[str, Any]) -> TurnSampling:
    _unsupported(body)
    max_tokens = _number(body, "max_completion_tokens", 1, 10**9, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 10**9, integer=True)
    top_k = _number(body, "top_k", -1, 10**9, integer=True)
    return TurnSampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 1e-9, 1.0),
        top_k=None if top_k in (None, 0) else top_k,
        seed=_number(body, "seed", -(2**63), 2**63 - 1, integer=True),
        stop=_stops(body),
        structured_outputs=_structured_outputs(body),
    )


def _answer_options(body: Mapping[str, Any], *, chat: bool) -> AnswerOptions:
    stream = bool(_typed(body, "stream", bool, "true or false"))
    stream_options = _typed(body, "stream_options", dict, "an object") or {}
    if chat:
        logprobs = bool(_typed(body, "logprobs", bool, "true or false"))
        if body.get("top_logprobs") not in (None, 0):
            raise invalid("top_logprobs: only the sampled token's log-prob is kept", "top_logprobs")
    else:  # completions: logprobs is the number of alternatives per token
        value = body.get("logprobs")
        if value is not None and (isinstance(value, bool) or value != 0):
            raise invalid("logprobs: 0 (the sampled token's log-prob only) or absent", "logprobs")
        logprobs = value is not None
    return AnswerOptions(
        stream=stream,
        include_usage=stream and bool(stream_options.get("include_usage")),
        logprobs=logprobs,
        return_token_ids=bool(_typed(body, "return_token_ids", bool, "true or false")),
    )


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{where}.content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content: a text part needs a string `text`", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{where}.content must be a string or a list of text parts", "messages")


def _canonical_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where}: a tool call needs function.name and arguments", "messages")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    # The same arguments however the agent serialised them; invalid JSON (the policy may have
    # produced it) is kept as sent.
    with contextlib.suppress(ValueError):
        arguments = json.dumps(json.loads(arguments))
    canonical = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        canonical["id"] = call["id"]
    return canonical


def canonical_message(message: Any, position: int) -> dict[str, Any]:
    """An OpenAI message as the gateway compares and renders it: text content, developer as
    system, tool-call arguments re-serialised; fields the template does not use dropped."""
    where = f"messages[{position}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        raise invalid(f"{where}.content is missing", "messages")
    canonical: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": "" if content is None else _text_content(content, where),
    }
    for name in ("name", "tool_call_id"):
        if isinstance(message.get(name), str):
            canonical[name] = message[name]
    if tool_calls:
        if not isinstance(tool_calls, list):
            raise invalid(f"{where}.tool_calls must be a list", "messages")
        canonical["tool_calls"] = [
            _canonical_tool_call(call, f"{where}.tool_calls[{k}]")
            for k, call in enumerate(tool_calls)
        ]
    return canonical


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list", "tools")
    for position, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise invalid(
                f"tools[{position}]: use {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"tools[{position}].function.name is missing", "tools")
    return tools or None


def parse_chat(body: Mapping[str, Any], model_name: str) -> tuple[ChatRequest, AnswerOptions]:
    check_model(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty list of chat messages is required", "messages")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise invalid(
            "tool_choice: 'auto' or 'none'; to force a call, constrain the output with "
            "structured_outputs",
            "tool_choice",
        )
    request = ChatRequest(
        messages=[canonical_message(m, k) for k, m in enumerate(messages)],
        tools=_tools(body),
        sampling=parse_sampling(body),
        parse_tool_calls=tool_choice != "none",
    )
    return request, _answer_options(body, chat=True)


def parse_completion(
    body: Mapping[str, Any], model_name: str
) -> tuple[CompletionRequest, AnswerOptions]:
    check_model(body, model_name)
    if body.get("echo") or body.get("suffix"):
        raise invalid("echo and suffix are not supported", "echo" if body.get("echo") else "suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request = CompletionRequest(prompt, None, parse_sampling(body))
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        request = CompletionRequest(None, tuple(prompt), parse_sampling(body))
    else:
        raise invalid(
            "prompt: one string or one list of token ids (batches: one session per trajectory)",
            "prompt",
        )
    return request, _answer_options(body, chat=False)


def parse_spec(body: Mapping[str, Any]) -> SessionSpec:
    unknown = sorted(set(body) - SPEC_FIELDS)
    if unknown:
        raise invalid(f"unknown fields {unknown}; known: {', '.join(sorted(SPEC_FIELDS))}")
    labels = body.get("labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise invalid("labels must map strings to strings", "labels")
    strings = {
        name: _typed(body, name, str, "a string") or ""
        for name in ("partition", "uid", "claim_id", "data_source", "ground_truth")
    }
    index = _number(body, "index", 0, 2**31 - 1, integer=True) or 0
    return SessionSpec(index=index, labels=labels, **strings)


# --- answers -----------------------------------------------------------------------------------


def _token_texts(sessions: AgentSessions, token_ids: tuple[int, ...]) -> list[str]:
    return [sessions.tokenizer.decode([token_id]) for token_id in token_ids]


def _usage(result: TurnResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _relayrl(result: TurnResult) -> dict[str, Any]:
    return {
        "session_id": result.session_id,
        "turn": result.turn,
        "replica": result.replica_id,
        "weight_versions": [
            {"version": version, "start": start, "end": end}
            for version, start, end in result.version_spans
        ],
    }


def _message(result: TurnResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        message["tool_calls"] = list(result.tool_calls)
    return message


def _chat_logprobs(sessions: AgentSessions, result: TurnResult) -> dict[str, Any]:
    return {
        "content": [
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
            for text, logprob in zip(
                _token_texts(sessions, result.token_ids), result.logprobs, strict=True
            )
        ]
    }


def _completion_logprobs(sessions: AgentSessions, result: TurnResult) -> dict[str, Any]:
    texts = _token_texts(sessions, result.token_ids)
    offsets, position = [], 0
    for text in texts:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": texts,
        "token_logprobs": list(result.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_completion(
    sessions: AgentSessions, result: TurnResult, model: str, options: AnswerOptions
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": _message(result),
        "finish_reason": result.finish_reason,
        "logprobs": _chat_logprobs(sessions, result) if options.logprobs else None,
    }
    answer: dict[str, Any] = {
        "id": f"chatcmpl-{result.session_id}-{result.turn}",
        "object": "chat.completion",
        "created": result.created,
        "model": model,
        "choices": [choice],
        "usage": _usage(result),
        "relayrl": _relayrl(result),
    }
    if options.return_token_ids:
        choice["token_ids"] = list(result.token_ids)
        answer["prompt_token_ids"] = list(result.prompt_token_ids)
    return answer


def completion(
    sessions: AgentSessions, result: TurnResult, model: str, options: AnswerOptions
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "logprobs": _completion_logprobs(sessions, result) if options.logprobs else None,
    }
    answer: dict[str, Any] = {
        "id": f"cmpl-{result.session_id}-{result.turn}",
        "object": "text_completion",
        "created": result.created,
        "model": model,
        "choices": [choice],
        "usage": _usage(result),
        "relayrl": _relayrl(result),
    }
    if options.return_token_ids:
        choice["token_ids"] = list(result.token_ids)
        answer["prompt_token_ids"] = list(result.prompt_token_ids)
    return answer


def chat_chunks(answer: dict[str, Any], options: AnswerOptions) -> Iterator[dict[str, Any]]:
    """A finished chat answer as `chat.completion.chunk`s: the message, then the finish."""
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    (choice,) = answer["choices"]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    first = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]}
    yield head | {"choices": [first], "relayrl": answer["relayrl"]}
    yield head | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}
    if options.include_usage:
        yield head | {"choices": [], "usage": answer["usage"]}


def completion_chunks(answer: dict[str, Any], options: AnswerOptions) -> Iterator[dict[str, Any]]:
    yield answer
    if options.include_usage:
        yield {k: answer[k] for k in ("id", "object", "created", "model")} | {
            "choices": [],
            "usage": answer["usage"],
        }


def error_body(error: AgentError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.kind.value,
            "param": error.param,
            "code": error.code,
        }
    }


def end_body(end: SessionEnd) -> dict[str, Any]:
    return {
        "session_id": end.session_id,
        "outcome": end.outcome,
        "trajectory_key": end.trajectory_key,
        "num_turns": end.num_turns,
        "num_prompt_tokens": end.num_prompt_tokens,
        "num_response_tokens": end.num_response_tokens,
        "reason": end.reason,
    }


# --- the server --------------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as an OpenAI-style error body, whatever raised it."""
    try:
        return await handler(request)
    except AgentError as exc:
        return web.json_response(error_body(exc), status=HTTP_STATUS[exc.kind])
    except web.HTTPException as exc:  # no route (404), wrong method (405), body too large (413)
        if exc.status < 400:
            raise
        return _error_response(exc.status, exc.text or exc.reason, "invalid_request_error")
    except Exception:
        logger.exception("agent HTTP %s %s failed", request.method, request.path)
        return _error_response(500, "internal error in the gateway (logged)", "server_error")


async def _json_body(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if optional and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _session_id(request: web.Request) -> str:
    in_path = request.match_info.get("session_id")
    in_header = request.headers.get(SESSION_HEADER)
    if in_path and in_header and in_path != in_header:
        raise invalid(f"the path names session {in_path} but {SESSION_HEADER} names {in_header}")
    session_id = in_path or in_header
    if not session_id:
        raise invalid(
            f"no session: use /sessions/<id>/v1/... or the {SESSION_HEADER} header "
            "(open a session with POST /sessions)"
        )
    return session_id


class AgentHttpServer:
    """The aiohttp server in the gateway's event loop."""

    def __init__(self, sessions: AgentSessions, config: AgentHttpConfig) -> None:
        self._sessions = sessions
        self._config = config
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the agent HTTP server is not started")
        return self._port

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self._config.max_request_bytes, middlewares=[openai_errors]
        )
        routes = [
            web.post("/sessions", self.open_session),
            web.get("/sessions/{session_id}", self.session_state),
            web.post("/sessions/{session_id}/close", self.close_session),
            web.post("/sessions/{session_id}/abort", self.abort_session),
        ]
        for prefix in ("/sessions/{session_id}/v1", "/v1"):
            routes += [
                web.post(f"{prefix}/chat/completions", self.chat),
                web.post(f"{prefix}/completions", self.complete),
                web.get(f"{prefix}/models", self.models),
            ]
        app.add_routes(routes)
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.application(), access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._config.host, self._config.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(
                f"cannot bind the agent HTTP endpoint to {self._config.host}:"
                f"{self._config.port} ({exc.strerror}); choose another agent_http.port "
                "(0 picks a free one) or agent_http.host"
            ) from None
        self._port = int(self._runner.addresses[0][1])
        logger.info(
            "agent HTTP endpoint on http://%s:%d/sessions/<id>/v1", self._config.host, self._port
        )
        return self._port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- lifecycle routes --------------------------------------------------------------------

    async def open_session(self, request: web.Request) -> web.Response:
        spec = parse_spec(await _json_body(request, optional=True))
        session = await self._sessions.open(spec)
        body = {
            "object": "agent.session",
            "session_id": session.session_id,
            "partition": session.partition,
            "uid": session.uid,
            "index": session.index,
            "base_path": f"/sessions/{session.session_id}/v1",
        }
        return web.json_response(body, status=201)

    async def session_state(self, request: web.Request) -> web.Response:
        session = self._sessions.get(request.match_info["session_id"])
        body = {
            "object": "agent.session",
            "session_id": session.session_id,
            "partition": session.partition,
            "uid": session.uid,
            "index": session.index,
            "kind": session.kind,
            "num_turns": session.num_turns,
            "num_prompt_tokens": len(session.prompt),
            "num_response_tokens": len(session.response),
            "replica": session.engine.replica_id,
            "busy": session.inflight is not None,
        }
        return web.json_response(body)

    async def close_session(self, request: web.Request) -> web.Response:
        end = await self._sessions.close_session(request.match_info["session_id"])
        return web.json_response(end_body(end))

    async def abort_session(self, request: web.Request) -> web.Response:
        body = await _json_body(request, optional=True)
        reason = _typed(body, "reason", str, "a string") or ""
        end = await self._sessions.abort(request.match_info["session_id"], reason)
        return web.json_response(end_body(end))

    # -- OpenAI routes -----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session_id = _session_id(request)
        self._sessions.get(session_id)  # an unknown or ended session first: 404 / 410
        chat, options = parse_chat(await _json_body(request), self._config.model_name)
        result = await self._sessions.chat(session_id, chat)
        answer = chat_completion(self._sessions, result, self._config.model_name, options)
        if options.stream:
            return await _event_stream(request, chat_chunks(answer, options))
        return web.json_response(answer)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        session_id = _session_id(request)
        self._sessions.get(session_id)
        prompt, options = parse_completion(await _json_body(request), self._config.model_name)
        result = await self._sessions.complete(session_id, prompt)
        answer = completion(self._sessions, result, self._config.model_name, options)
        if options.stream:
            return await _event_stream(request, completion_chunks(answer, options))
        return web.json_response(answer)

    async def models(self, request: web.Request) -> web.Response:
        if request.match_info.get("session_id") or request.headers.get(SESSION_HEADER):
            self._sessions.get(_session_id(request))  # 404 / 410 for a wrong session
        model = {
            "id": self._config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "relayrl",
        }
        return web.json_response({"object": "list", "data": [model]})


async def _event_stream(
    request: web.Request, chunks: Iterator[dict[str, Any]]
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
