"""Deprecated: the agent sessions moved to `relayrl.gateway.agent_http` (the service in
`relayrl.gateway.agent_http.sessions`, its pieces beside it). The old names keep working, with
a DeprecationWarning naming the new place, for this release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_PACKAGE = "relayrl.gateway.agent_http"
_MOVED = {
    **dict.fromkeys(("ErrorKind", "AgentError"), f"{_PACKAGE}.errors"),
    **dict.fromkeys(
        (
            "SessionSpec",
            "TurnSampling",
            "ChatRequest",
            "CompletionRequest",
            "TurnResult",
            "Outcome",
            "SessionEnd",
        ),
        f"{_PACKAGE}.domain",
    ),
    **dict.fromkeys(("render_chat", "encode", "appended_token_ids"), f"{_PACKAGE}.template"),
    **dict.fromkeys(("AgentSession", "SESSION_LABEL"), f"{_PACKAGE}.session"),
    **dict.fromkeys(("AgentSessions", "MAX_ENDED_REMEMBERED"), f"{_PACKAGE}.sessions"),
    "AGENT_LOOP_NAME": f"{_PACKAGE}.store",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"relayrl.gateway.sessions.{name} moved to {module}", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module(module), name)
