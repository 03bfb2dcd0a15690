"""The OpenAI-compatible HTTP endpoint for black-box agents (docs/architecture.md, "Black-box
agents"): an agent we cannot look into (any program speaking the OpenAI API) converses through
a session, and the gateway does the token accounting it cannot do.

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

A session is one trajectory, recorded as the built-in loops record theirs:
- turn 0: prompt = the chat template over the request's messages (and tools);
- turn k > 0: the request must *extend* the conversation: the previous request's messages,
  then the assistant message the gateway returned, then new messages (tool results, user
  turns). The engine prompt is then prompt + response so far (the exact sampled ids, never
  re-tokenised) + the new messages' tokens as the template renders them after an assistant
  turn (observation, response_mask 0, log-prob 0.0). Generated tokens get mask 1, their
  log-probs, and one span per weight version, turn and replica.
- A request that does NOT extend the conversation (the agent changed its tools, edited,
  dropped or rewrote earlier turns, summarised its history) starts a new *segment* of the
  same sample: its own prompt, rendered from the request, and its own response. The recorded
  tokens stay what the policy saw: a context that changed mid-way is never glued onto the old
  one, which would train on a sequence no engine ever produced. A request that extends an
  earlier segment continues that one. Every segment is trained with the sample's advantage
  (docs/architecture.md#segments). With `agent_http.segments: false` such a request is
  refused with 409 `conversation_diverged` instead.
Completions requests work the same way on raw text (the new prompt must start with the
previous prompt + the returned text) or on token ids (they must start with the recorded ids).

Which group the trajectory belongs to: a session opened with `uid`, `index` and `claim_id`
rolls out that sample of a group its caller claimed; otherwise the session creates an ad-hoc
group of one sample (prompt = the first rendered prompt, data_source, ground_truth and labels
from the open call, prompt_step = the trainer's current step) once its first generation
succeeds, and claims it.

The pieces, the way vLLM splits its OpenAI server:
- `protocol`: the JSON of every route as pydantic models, one module per route;
- `router`: the aiohttp routes, HTTP <-> protocol models <-> `AgentSessions`;
- `sessions`: `AgentSessions`, the service: open, serve turns, close, abort, upkeep;
- `conversations`: one strategy per request kind (chat, text and token completions);
- `session`: one session's state; `store`: its claims, leases and puts in the TransferQueue;
- `domain`, `errors`, `template`: the requests and results, the error kinds, the chat
  template pieces.
"""

from relayrl.gateway.agent_http.domain import (
    ChatRequest,
    CompletionRequest,
    SessionEnd,
    SessionSpec,
    TurnResult,
    TurnSampling,
)
from relayrl.gateway.agent_http.errors import AgentError, ErrorKind
from relayrl.gateway.agent_http.router import AgentHttpServer
from relayrl.gateway.agent_http.session import AgentSession
from relayrl.gateway.agent_http.sessions import AgentSessions

__all__ = [
    "AgentError",
    "AgentHttpServer",
    "AgentSession",
    "AgentSessions",
    "ChatRequest",
    "CompletionRequest",
    "ErrorKind",
    "SessionEnd",
    "SessionSpec",
    "TurnResult",
    "TurnSampling",
]
