"""The agent endpoint's HTTP side: aiohttp routes that turn JSON into the protocol's request
models, call the session service (`AgentSessions`) and answer with the protocol's answer models;
every failure in OpenAI's error shape with its status code."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from relayrl.gateway.agent_http.access import AgentAccess, Refusal
from relayrl.gateway.agent_http.errors import AgentError, ErrorKind, invalid
from relayrl.gateway.agent_http.protocol import (
    AbortSessionRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CloseSessionRequest,
    CompletionResponse,
    CompletionsRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenSessionRequest,
    SessionEnded,
    SessionOpened,
    SessionState,
    parse,
)
from relayrl.gateway.agent_http.protocol.responses import (
    ResponseObject,
    ResponsesRequest,
    event_lines,
)
from relayrl.gateway.agent_http.sessions import AgentSessions
from relayrl.gateway.config import AgentHttpConfig

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Relayrl-Session"
HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.ENDED: 410,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.TOO_MANY: 429,
    ErrorKind.ENGINE: 502,
    ErrorKind.UNAVAILABLE: 503,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(answer: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(answer.model_dump(), status=status)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as an OpenAI-style error body, whatever raised it."""
    try:
        return await handler(request)
    except AgentError as exc:
        return _json(ErrorResponse.of(exc), HTTP_STATUS[exc.kind])
    except web.HTTPException as exc:  # no route (404), wrong method (405), body too large (413)
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 404:
            message = (
                f"no route {request.method} {request.path}; a session serves "
                "/sessions/<id>/v1/chat/completions, /v1/completions, /v1/responses and "
                "/v1/models "
                "(docs/openai-surface.md)"
            )
        body = ErrorResponse.plain(message, ErrorKind.INVALID.value)
        return _json(body, exc.status)
    except Exception:
        logger.exception("agent HTTP %s %s failed", request.method, request.path)
        return _json(
            ErrorResponse.plain("internal error in the gateway (logged)", "server_error"), 500
        )


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


def _refused(refusal: Refusal) -> web.Response:
    kind = "authentication_error" if refusal.status == 401 else "permission_error"
    return _json(ErrorResponse.plain(refusal.message, kind), refusal.status)


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


async def _event_stream(request: web.Request, chunks: Iterator[BaseModel]) -> web.StreamResponse:
    """Chat and completions chunks as server-sent events, ended by `[DONE]`."""
    lines = (f"data: {json.dumps(chunk.model_dump())}\n\n".encode() for chunk in chunks)
    return await _stream(request, itertools.chain(lines, [b"data: [DONE]\n\n"]))


async def _stream(request: web.Request, lines: Iterator[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for line in lines:
        await response.write(line)
    await response.write_eof()
    return response


class AgentHttpServer:
    """The aiohttp server in the gateway's event loop; with `access`, every route but the
    open one needs a token (relayrl.gateway.agent_http.access)."""

    def __init__(
        self,
        sessions: AgentSessions,
        config: AgentHttpConfig,
        access: AgentAccess | None = None,
    ) -> None:
        self._sessions = sessions
        self._config = config
        self._access = access
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the agent HTTP server is not started")
        return self._port

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self._config.max_request_bytes,
            middlewares=[openai_errors, self._authenticated],
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
                web.post(f"{prefix}/responses", self.respond),
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

    @web.middleware
    async def _authenticated(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """401 / 403 unless the request's token may call its route (no check without
        `access`). Opening a session is checked in its handler, which needs the opener."""
        if self._access is None or request.match_info.http_exception is not None:
            return await handler(request)  # no authentication, or no such route: 404 / 405
        if request.path == "/sessions" and request.method == "POST":
            return await handler(request)
        session_id = request.match_info.get("session_id") or request.headers.get(SESSION_HEADER)
        refusal = self._access.check(request.headers.get("Authorization"), session_id)
        if refusal is not None:
            return _refused(refusal)
        return await handler(request)

    # -- lifecycle routes --------------------------------------------------------------------

    async def open_session(self, request: web.Request) -> web.Response:
        opener = None
        if self._access is not None:
            opener = self._access.opener(request.headers.get("Authorization"))
            if isinstance(opener, Refusal):
                return _refused(opener)
        body = parse(OpenSessionRequest, await _json_body(request, optional=True))
        session = await self._sessions.open_for_caller(body.to_domain())
        opened = SessionOpened(
            session_id=session.session_id,
            partition=session.partition,
            uid=session.uid,
            index=session.index,
            base_path=f"/sessions/{session.session_id}/v1",
            token=self._sessions.tokens.mint(session.session_id, opener)
            if self._access is not None
            else None,
        )
        return _json(opened, status=201)

    async def session_state(self, request: web.Request) -> web.Response:
        session = self._sessions.get(request.match_info["session_id"])
        state = SessionState(
            session_id=session.session_id,
            partition=session.partition,
            uid=session.uid,
            index=session.index,
            kind=session.kind,
            num_turns=session.num_turns,
            num_prompt_tokens=sum(len(s.transcript.prompt) for s in session.segments),
            num_response_tokens=session.num_response_tokens,
            replica=session.engine.replica_id,
            busy=session.activity.busy,
        )
        return _json(state)

    async def close_session(self, request: web.Request) -> web.Response:
        body = parse(CloseSessionRequest, await _json_body(request, optional=True))
        end = await self._sessions.close_session(
            request.match_info["session_id"], env_reward=body.env_reward
        )
        return _json(SessionEnded.of(end))

    async def abort_session(self, request: web.Request) -> web.Response:
        body = parse(AbortSessionRequest, await _json_body(request, optional=True))
        end = await self._sessions.abort(request.match_info["session_id"], body.reason)
        return _json(SessionEnded.of(end))

    # -- OpenAI routes -----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session_id = _session_id(request)
        self._sessions.get(session_id)  # an unknown or ended session first: 404 / 410
        body = parse(ChatCompletionRequest, await _json_body(request), self._config.model_name)
        result = await self._sessions.chat(session_id, body.to_domain())
        options = body.options()
        answer = ChatCompletionResponse.of(
            result, self._config.model_name, options, self._token_texts
        )
        if options.stream:
            return await _event_stream(request, answer.chunks(options))
        return _json(answer)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        session_id = _session_id(request)
        self._sessions.get(session_id)
        body = parse(CompletionsRequest, await _json_body(request), self._config.model_name)
        result = await self._sessions.complete(session_id, body.to_domain())
        options = body.options()
        answer = CompletionResponse.of(result, self._config.model_name, options, self._token_texts)
        if options.stream:
            return await _event_stream(request, answer.chunks(options))
        return _json(answer)

    async def respond(self, request: web.Request) -> web.StreamResponse:
        session_id = _session_id(request)
        self._sessions.get(session_id)
        body = parse(ResponsesRequest, await _json_body(request), self._config.model_name)
        result = await self._sessions.chat(session_id, body.to_domain())
        answer = ResponseObject.of(result, self._config.model_name, body, self._token_texts)
        if body.stream:
            return await _stream(request, event_lines(answer.events()))
        return _json(answer)

    async def models(self, request: web.Request) -> web.Response:
        if request.match_info.get("session_id") or request.headers.get(SESSION_HEADER):
            self._sessions.get(_session_id(request))  # 404 / 410 for a wrong session
        card = ModelCard(id=self._config.model_name, created=int(time.time()))
        return _json(ModelList(data=[card]))

    def _token_texts(self, token_ids: Sequence[int]) -> list[str]:
        tokenizer = self._sessions.tokenizer
        return [tokenizer.decode([token_id]) for token_id in token_ids]
