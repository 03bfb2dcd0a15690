"""What can go wrong in an agent session, independent of the transport: the HTTP router maps an
`ErrorKind` to a status code and OpenAI's error body, the gRPC servicer to a status code."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong; the value is the `type` of OpenAI's error body."""

    INVALID = "invalid_request_error"
    NOT_FOUND = "not_found_error"
    CONFLICT = "conflict_error"
    ENDED = "session_ended"
    TOO_MANY = "too_many_sessions"
    FORBIDDEN = "permission_error"
    ENGINE = "engine_error"
    UNAVAILABLE = "service_unavailable"


class AgentError(Exception):
    def __init__(
        self, kind: ErrorKind, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code


def invalid(message: str, param: str | None = None) -> AgentError:
    return AgentError(ErrorKind.INVALID, message, param=param)


DIVERGED = "conversation_diverged"


def diverged(detail: str) -> AgentError:
    """The request does not extend the session's conversation."""
    return AgentError(
        ErrorKind.CONFLICT,
        f"the request does not extend the session's conversation: {detail}. The gateway "
        "records the tokens the policy saw; an agent that edits earlier turns opens a new "
        "session for the new context",
        param="messages",
        code=DIVERGED,
    )
