"""Who may call an engine: an ASGI middleware that vLLM's API server runs in front of every
route (`--middleware relayrl.engine.guard.EngineGuard`), because vLLM's own `--api-key`
guards only the OpenAI routes (/v1, /inference, ...) and not the development endpoints relayrl
needs (/collective_rpc runs code on the workers, /pause stops serving).

Callers send `Authorization: Bearer <token>`; the tokens file (RELAYRL_ENGINE_CALLERS_FILE:
YAML principal -> token or `sha256:<hex>`, the services' tokens file) names them, and each
route is allowed to some roles (a principal's role is its name):

    weightsync     loads weights (/collective_rpc), labels the version, pauses and resumes
    gateway        generates (/inference, /v1), pauses, resumes (labelling the version it
                   routes to), aborts requests
    operator       generates (evaluation) and reads the weight label

Health and metrics stay open (probes, Prometheus); every other route is refused to everyone,
and /collective_rpc runs only relayrl's own worker methods (`relayrl_*`), whoever calls.
A missing or unknown token is 401 and a caller in the wrong role 403, both in OpenAI's error
shape. Without the variable the guard is not installed (relayrl.engine.launcher).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from relayrl.core.access import GATEWAY, OPERATOR, WEIGHTSYNC
from relayrl.core.config import ConfigError, StaticTokenAuthConfig, load_static_tokens
from relayrl.core.interceptors import StaticTokenAuthenticator

CALLERS_ENV = "RELAYRL_ENGINE_CALLERS_FILE"

OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})
# (path, or prefix ending in "/") -> the roles allowed
ROUTES: tuple[tuple[str, frozenset[str]], ...] = (
    ("/collective_rpc", frozenset({WEIGHTSYNC})),
    ("/update_weight_version", frozenset({WEIGHTSYNC, GATEWAY})),
    ("/reset_prefix_cache", frozenset({WEIGHTSYNC, GATEWAY})),
    ("/pause", frozenset({WEIGHTSYNC, GATEWAY})),
    ("/resume", frozenset({WEIGHTSYNC, GATEWAY})),
    ("/is_paused", frozenset({WEIGHTSYNC, GATEWAY, OPERATOR})),
    ("/weight_info", frozenset({WEIGHTSYNC, GATEWAY, OPERATOR})),
    ("/abort_requests", frozenset({GATEWAY})),
    ("/inference/", frozenset({GATEWAY, OPERATOR})),
    ("/v1/", frozenset({GATEWAY, OPERATOR})),
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def allowed_roles(path: str) -> frozenset[str]:
    """The roles that may call `path` (empty: nobody)."""
    for route, roles in ROUTES:
        if path == route or (route.endswith("/") and path.startswith(route)):
            return roles
    return frozenset()


def load_callers(path: Path) -> StaticTokenAuthenticator:
    """The authenticator of the callers file; ConfigError naming it when it cannot work."""
    config = StaticTokenAuthConfig(type="static_token", tokens_file=path)
    return StaticTokenAuthenticator(load_static_tokens(config))


class EngineGuard:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(EngineGuard)`)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        path = os.environ.get(CALLERS_ENV)
        if not path:
            raise ConfigError(f"{CALLERS_ENV} is not set: the engine guard has no callers file")
        self._callers = load_callers(Path(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        principal = self._callers.authenticate(path, headers)
        if principal is None:
            await _refuse(send, 401, f"{path} needs 'Authorization: Bearer <token>'")
            return
        roles = allowed_roles(path)
        if principal.name not in roles:
            who = ", ".join(sorted(roles)) or "no caller"
            await _refuse(send, 403, f"{path} is for {who}; {principal.name!r} may not call it")
            return
        if path == "/collective_rpc":
            body = await _read_body(receive)
            if body is None or (method := _rpc_method(body)) is None:
                await _refuse(send, 400, "/collective_rpc: the body must be JSON naming a method")
                return
            if not method.startswith(WORKER_METHOD_PREFIX):
                message = f"/collective_rpc: only relayrl's worker methods, not {method[:100]!r}"
                await _refuse(send, 403, message)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


WORKER_METHOD_PREFIX = "relayrl_"
"""/collective_rpc runs any method of the workers by name; only relayrl's worker extension's
(relayrl.engine.worker_extension) are let through, whoever calls."""
MAX_RPC_BODY_BYTES = 1 << 20


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body (None past MAX_RPC_BODY_BYTES)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_RPC_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _rpc_method(body: bytes) -> str | None:
    try:
        method = json.loads(body).get("method")
    except (ValueError, AttributeError):
        return None
    return method if isinstance(method, str) else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then the server's own (which
    reports the client's disconnect when it comes)."""
    sent = False

    async def replayed() -> MutableMapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(send: Send, status: int, message: str) -> None:
    kinds = {401: "authentication_error", 403: "permission_error"}
    kind = kinds.get(status, "invalid_request_error")
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
