"""The agent sessions' own objects, whatever transport brought them: what a session rolls out,
the requests of its turns, what a turn answers and how a session ends."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from relayrl.gateway.agent_http.errors import AgentError, ErrorKind, invalid
from relayrl.tq.codec import check_partition_name, check_uid
from relayrl.tq.errors import InvalidInputError

# What a session converses in (fixed by its first request) and what one request asks for.
SessionKind = Literal["chat", "completion"]
RequestKind = Literal["chat", "text_completion", "token_completion"]
Outcome = Literal["finished", "failed", "discarded"]


# --- opening a session ---------------------------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    """What a session rolls out: a claimed group's sample, or (uid empty) an ad-hoc group."""

    partition: str = ""
    uid: str = ""
    index: int = 0
    claim_id: str = ""
    data_source: str = ""
    ground_truth: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


def checked_spec(spec: SessionSpec, session_id: str, default_partition: str) -> SessionSpec:
    """The spec a session runs with: an ad-hoc group gets its uid and partition; a claimed
    group's sample is checked for what can be checked without the TransferQueue."""
    if not spec.uid:
        if spec.index or spec.claim_id:
            raise invalid("index and claim_id need the uid of the claimed group", "uid")
        if spec.ground_truth:
            raise invalid(
                "ground_truth: a caller cannot set the ground truth its own answer is scored "
                "against; report the environment's reward with the close (env_reward) instead",
                "ground_truth",
            )
        return SessionSpec(
            partition=_partition(spec.partition or default_partition),
            uid=f"agent-{session_id}",
            index=0,
            data_source=spec.data_source,
            labels=dict(spec.labels),
        )
    try:
        check_uid(spec.uid)
    except InvalidInputError as exc:
        raise invalid(str(exc), "uid") from None
    if not spec.claim_id:
        raise invalid(
            "claim_id: a session on group uid rolls out a sample the caller has claimed; "
            "pass the claim id (or leave uid empty for an ad-hoc group)",
            "claim_id",
        )
    if not spec.partition:
        raise invalid("partition: name the partition of the claimed group", "partition")
    if spec.index < 0:
        raise invalid(f"index must be >= 0, got {spec.index}", "index")
    if spec.data_source or spec.ground_truth or spec.labels:
        raise invalid(
            "data_source, ground_truth and labels come from the claimed group; set them "
            "only for ad-hoc sessions",
            "data_source",
        )
    return SessionSpec(
        partition=_partition(spec.partition),
        uid=spec.uid,
        index=spec.index,
        claim_id=spec.claim_id,
    )


def _partition(name: str) -> str:
    try:
        return check_partition_name(name)
    except InvalidInputError as exc:
        raise AgentError(ErrorKind.INVALID, str(exc), param="partition") from None


# --- a turn's request --------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnSampling:
    """A request's sampling; None: the group's value (claimed groups) or the default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    # Strings that end the generation, found on the detokenised text as vLLM finds them; the
    # returned text leaves the one found out unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    top_logprobs: int = 0  # alternatives per token the answer shows, from the engine
    structured_outputs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ChatRequest:
    # Canonical messages: {"role", "content": str} plus "name", "tool_call_id" and (assistant)
    # "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}].
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: TurnSampling
    # Parse <tool_call> blocks into tool_calls (tools given and tool_choice is not "none").
    parse_tool_calls: bool = True

    kind: ClassVar[RequestKind] = "chat"

    def fingerprint(self) -> str:
        return fingerprint("chat", self.messages, self.tools, self.sampling)


@dataclass(frozen=True)
class CompletionRequest:
    # Exactly one of the two.
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: TurnSampling

    @property
    def kind(self) -> RequestKind:
        return "text_completion" if self.prompt_text is not None else "token_completion"

    def fingerprint(self) -> str:
        return fingerprint("completion", self.prompt_text, self.prompt_token_ids, self.sampling)


TurnRequest = ChatRequest | CompletionRequest


def fingerprint(*parts: Any) -> str:
    """The same JSON for the same request (a client's retry is answered from the record)."""

    def default(value: Any) -> Any:
        if isinstance(value, TurnSampling):
            return value.__dict__
        if isinstance(value, Mapping):
            return dict(value)
        raise TypeError(type(value).__name__)

    return json.dumps(parts, sort_keys=True, default=default)


# --- what a turn answers, how a session ends ---------------------------------------------------


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    turn: int
    created: int  # unix seconds
    prompt_token_ids: tuple[int, ...]  # what the engine was given
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    # The generated text, special tokens skipped, up to the stop string that ended it.
    text: str
    # OpenAI's reason: "stop", "length" or "tool_calls".
    finish_reason: str
    replica_id: str
    # (policy version, start, end) over token_ids; -1: an engine nobody versioned.
    version_spans: tuple[tuple[int, int, int], ...]
    # Chat only: the assistant message as returned (and expected back in the next request).
    content: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    # The generated text after `text`: the stop string that ended the generation (unless it
    # was asked for) and what its last token decodes to beyond it. Recorded, not returned.
    held_back: str = ""
    # Per token, the engine's most likely alternatives as (token id, log-prob), best first;
    # empty unless the request asked for top_logprobs.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class SessionEnd:
    session_id: str
    outcome: Outcome
    trajectory_key: str
    num_turns: int
    num_prompt_tokens: int
    num_response_tokens: int
    reason: str = ""
