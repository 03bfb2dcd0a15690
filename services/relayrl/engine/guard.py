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

Health and metrics stay open (probes, Prometheus); every other route is refused to everyone.
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
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, message: str) -> None:
    kind = "authentication_error" if status == 401 else "permission_error"
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
