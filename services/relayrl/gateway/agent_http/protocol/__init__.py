"""The agent endpoint's JSON: one pydantic model per request and per answer of each route, the
way vLLM's OpenAI server declares its protocol.

A request model checks its fields in the order they are declared and the first problem is
reported in OpenAI's error shape with the parameter it concerns (`parse`); each field's check
lives in `checks`. Fields a model does not declare are ignored (OpenAI clients send more than
the gateway uses), except on POST /sessions, whose fields are all the gateway's own.

An answer model is built from the session service's result (`TurnResult`, `SessionEnd`) and
dumped as the route's JSON. Fields in a model's `omit_if_none` are left out when None; every
other field is always there, `null` included, as OpenAI's clients expect.

- `base`: parsing, the shared field types, the answers' base, errors, usage, `relayrl`;
- `chat`: POST .../v1/chat/completions; `completions`: POST .../v1/completions;
- `responses`: POST .../v1/responses (OpenAI's Responses API, served as chat);
- `sessions`: POST /sessions, GET /sessions/{id}, close, abort, and GET .../v1/models.
"""

from relayrl.gateway.agent_http.protocol.base import AnswerOptions, ErrorResponse, parse
from relayrl.gateway.agent_http.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from relayrl.gateway.agent_http.protocol.completions import CompletionResponse, CompletionsRequest
from relayrl.gateway.agent_http.protocol.sessions import (
    AbortSessionRequest,
    CloseSessionRequest,
    ModelCard,
    ModelList,
    OpenSessionRequest,
    SessionEnded,
    SessionOpened,
    SessionState,
)

__all__ = [
    "AbortSessionRequest",
    "AnswerOptions",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CloseSessionRequest",
    "CompletionResponse",
    "CompletionsRequest",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "OpenSessionRequest",
    "SessionEnded",
    "SessionOpened",
    "SessionState",
    "parse",
]
