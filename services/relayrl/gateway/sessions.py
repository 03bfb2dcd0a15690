"""Black-box agent sessions: the token accounting behind the OpenAI-compatible endpoint.

A session is one trajectory. An agent we cannot look into (any program speaking the OpenAI
API) sends chat or completion requests to `/sessions/<id>/v1`; the gateway renders them with
the policy's chat template, generates on the session's sticky replica (request id = session
id, so every turn hits the replica whose prefix cache holds the conversation) and records the
same `Trajectory` the built-in loops write (003 §5.3-5.4):

- turn 0: prompt = the chat template over the request's messages (and tools);
- turn k > 0: the request must *extend* the conversation: the previous request's messages,
  then the assistant message the gateway returned, then new messages (tool results, user
  turns). The engine prompt is then prompt + response so far (the exact sampled ids, never
  re-tokenised) + the new messages' tokens as the template renders them after an assistant
  turn (observation, response_mask 0, log-prob 0.0). Generated tokens get mask 1, their
  log-probs, and one span per weight version, turn and replica.
- A request that does NOT extend the conversation (the agent edited, dropped or reordered
  earlier turns) is refused with 409 `conversation_diverged`: the recorded tokens are what
  the policy saw, and a trajectory whose context silently changed mid-way would train on a
  sequence no engine ever produced. An agent that compacts its history opens a new session
  for the new context.
- The same request sent again (a client retry after a lost answer) gets the recorded answer
  back without generating again.

Completions requests work the same way on raw text (the new prompt must start with the
previous prompt + the returned text) or on token ids (they must start with the recorded ids).

Which group the trajectory belongs to: a session opened with `uid`, `index` and `claim_id`
rolls out that sample of a group its caller claimed; otherwise the session creates an ad-hoc
group of one sample (prompt = the first rendered prompt, data_source, ground_truth and labels
from the open call, prompt_step = the trainer's current step) once its first generation
succeeds, and claims it. The TransferQueue claims the oldest pending groups and cannot claim
one by uid, so the gateway claims one at a time until it holds its own group and releases the
ones it passed over; `agent_http.partition` defaults to a partition of its own ("agent") so
that nothing normally lies ahead. Ad-hoc groups name the agent loop "agent_http", which no
rollout loop has: if one ever returns to pending (a gateway crashed), a rollout worker fails
it as infra instead of rolling it out with another loop.

Ending a session: close puts the trajectory as finished (the reward-service scores it); abort
puts it as failed (is_infra) with the reason, and a session in which nothing was generated is
discarded (nothing written; a caller that claimed the group keeps its claim). Sessions idle for
`session_idle_timeout_s` are aborted; a claim lost while the session runs ends it (nothing
can be written under it any more).

Engine failures do not end a session: the failed generation is not recorded, the agent gets
502 (engine error or timeout) or 503 (no replica serving, e.g. during a weight update) and may
send the same request again; whoever drives the agent aborts the session if it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from relayrl.conversation.rendering import turn_end_token_ids
from relayrl.conversation.tool_calls import TOOL_CALL_OPEN, parse_tool_calls
from relayrl.gateway.agents import ResponseBuilder
from relayrl.gateway.config import AgentHttpConfig
from relayrl.gateway.replicas import NoReplicaAvailable, ReplicaPool
from relayrl.gateway.rollout import EngineTimeout, StickySession, trajectory_of
from relayrl.inference.client import EngineError, EngineRejected, Generation, SamplingOptions
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import ClaimedGroup, TrajectoryPut, TransferQueue
from relayrl.tq.codec import check_uid
from relayrl.tq.errors import (
    ConflictError,
    InvalidInputError,
    StaleClaimError,
    TQError,
    UnknownKeyError,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

AGENT_LOOP_NAME = "agent_http"
SESSION_LABEL = "agent_session"
# Groups passed over (claimed and released again) while claiming an ad-hoc group, at most.
MAX_PASSED_GROUPS = 16
MAX_ENDED_REMEMBERED = 4096


class ErrorKind(enum.Enum):
    """What went wrong, independent of the transport (HTTP status, gRPC code)."""

    INVALID = "invalid_request_error"
    NOT_FOUND = "not_found_error"
    CONFLICT = "conflict_error"
    ENDED = "session_ended"
    TOO_MANY = "too_many_sessions"
    ENGINE = "engine_error"
    UNAVAILABLE = "service_unavailable"


class AgentError(Exception):
    def __init__(
        self, kind: ErrorKind, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code


# --- requests and results -------------------------------------------------------------------


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


@dataclass(frozen=True)
class TurnSampling:
    """A request's sampling; None: the group's value (claimed groups) or the default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
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

    def fingerprint(self) -> str:
        return _fingerprint("chat", self.messages, self.tools, self.sampling)


@dataclass(frozen=True)
class CompletionRequest:
    # Exactly one of the two.
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: TurnSampling

    def fingerprint(self) -> str:
        return _fingerprint("completion", self.prompt_text, self.prompt_token_ids, self.sampling)


def _fingerprint(*parts: Any) -> str:
    def default(value: Any) -> Any:
        if isinstance(value, TurnSampling):
            return value.__dict__
        if isinstance(value, Mapping):
            return dict(value)
        raise TypeError(type(value).__name__)

    return json.dumps(parts, sort_keys=True, default=default)


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    turn: int
    created: int  # unix seconds
    prompt_token_ids: tuple[int, ...]  # what the engine was given
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str  # the generated text, special tokens skipped
    # OpenAI's reason: "stop", "length" or "tool_calls".
    finish_reason: str
    replica_id: str
    # (policy version, start, end) over token_ids; -1: an engine nobody versioned.
    version_spans: tuple[tuple[int, int, int], ...]
    # Chat only: the assistant message as returned (and expected back in the next request).
    content: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()


Outcome = Literal["finished", "failed", "discarded"]


@dataclass(frozen=True)
class SessionEnd:
    session_id: str
    outcome: Outcome
    trajectory_key: str
    num_turns: int
    num_prompt_tokens: int
    num_response_tokens: int
    reason: str = ""


# --- chat template pieces ---------------------------------------------------------------------


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    """The chat template's text; AgentError(INVALID) when the template refuses the input."""
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except (jinja2.TemplateError, TypeError) as exc:
        raise AgentError(
            ErrorKind.INVALID, f"the policy's chat template cannot render these messages: {exc}"
        ) from None
    assert isinstance(text, str)
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # Rendered text carries its own special tokens: no BOS/EOS around it.
    return list(tokenizer.encode(text, add_special_tokens=False))


_SENTINEL = "relayrl-assistant-content-sentinel"


def appended_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    last_generated_id: int | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[int]:
    """Tokens between an assistant turn and the next generation when `messages` (any roles)
    follow it: what the template renders after an assistant message, up to and including
    the generation prompt. A closing special token the generation already ends with is not
    repeated. (agents.observation_token_ids does this for tool messages only.)"""
    before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    head = render_chat(tokenizer, before, tools, add_generation_prompt=False)
    full = render_chat(tokenizer, [*before, *messages], tools, add_generation_prompt=True)
    if not full.startswith(head):
        raise AgentError(
            ErrorKind.INVALID,
            "the chat template renders earlier turns differently once these messages follow; "
            "the gateway cannot append them to the sampled tokens",
        )
    closing = head[head.rindex(_SENTINEL) + len(_SENTINEL) :]
    added = tokenizer.added_tokens_decoder
    if last_generated_id is not None and last_generated_id in added:
        piece = added[last_generated_id].content
        if closing.startswith(piece):
            closing = closing[len(piece) :]
    return encode(tokenizer, closing + full[len(head) :])


def _message_key(message: Mapping[str, Any]) -> str:
    """What must match for a message to count as the same turn (content up to surrounding
    whitespace, which agents trim; the policy saw the recorded tokens either way)."""
    key = dict(message)
    key["content"] = (key.get("content") or "").strip()
    return json.dumps(key, sort_keys=True)


def _stop_token_ids(tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> tuple[int, ...]:
    ids = []
    for stop in stops:
        encoded = encode(tokenizer, stop)
        if len(encoded) != 1:
            raise AgentError(
                ErrorKind.INVALID,
                f"stop {stop!r} is {len(encoded)} tokens; the gateway stops on single tokens only "
                "(e.g. '</tool_call>'); drop it or use a one-token stop",
                param="stop",
            )
        ids.append(encoded[0])
    return tuple(ids)


# --- one session ------------------------------------------------------------------------------


@dataclass
class _Plan:
    """A turn ready to generate: computed synchronously, recorded only if generation works."""

    engine_prompt: list[int]
    observation: list[int]
    sampling: SamplingOptions
    fingerprint: str
    messages: list[dict[str, Any]] | None = None  # chat
    tools: list[dict[str, Any]] | None = None
    parse_tool_calls: bool = False
    prompt_text: str | None = None  # completions on text


class AgentSession:
    def __init__(self, session_id: str, spec: SessionSpec, engine: StickySession) -> None:
        self.session_id = session_id
        self.spec = spec
        self.partition = spec.partition
        self.uid = spec.uid
        self.index = spec.index
        self.claim_id = spec.claim_id
        self.engine = engine
        # The claimed group (read at open), or the ad-hoc group once created.
        self.group: common_pb2.PromptGroup | None = None
        self.kind: Literal["chat", "completion"] | None = None
        self.prompt: list[int] = []
        self.response = ResponseBuilder()
        self.num_turns = 0
        self.finish_reason = ""
        self.history: list[dict[str, Any]] = []  # chat: messages incl. the replies returned
        self.tools: list[dict[str, Any]] | None = None
        self.text: str | None = None  # completions on text: prompt + returned texts
        self.last_fingerprint = ""
        self.last_result: TurnResult | None = None
        self.last_generated_id: int | None = None
        self.opened_at = time.time()
        self.last_active = time.monotonic()
        self.answered_at: float | None = None
        self.generate_s = 0.0
        self.agent_s = 0.0
        # The request being served, and within it the engine call (what an abort cancels).
        self.inflight: asyncio.Task[TurnResult] | None = None
        self.generating: asyncio.Task[Generation] | None = None
        self.ending = False
        self.abort_reason = ""

    @property
    def trajectory_key(self) -> str:
        return f"{self.uid}_{self.index}"

    def end(self, outcome: Outcome, reason: str = "") -> SessionEnd:
        written = outcome != "discarded"
        return SessionEnd(
            session_id=self.session_id,
            outcome=outcome,
            trajectory_key=self.trajectory_key if written else "",
            num_turns=self.num_turns,
            num_prompt_tokens=len(self.prompt),
            num_response_tokens=len(self.response),
            reason=reason,
        )


# --- the session table ------------------------------------------------------------------------


class AgentSessions:
    """Every open agent session of this gateway, and what their requests do."""

    def __init__(
        self,
        *,
        tq: TransferQueue,
        pool: ReplicaPool,
        tokenizer: PreTrainedTokenizerBase,
        config: AgentHttpConfig,
        claimer: str,
        lease_s: float,
        request_timeout_s: float,
        policy_step: Callable[[], int] = lambda: 0,
    ) -> None:
        self._tq = tq
        self._pool = pool
        self.tokenizer = tokenizer
        self.config = config
        self._claimer = claimer
        self._lease_s = lease_s
        self._request_timeout_s = request_timeout_s
        self._policy_step = policy_step
        self._sessions: dict[str, AgentSession] = {}
        self._samples: dict[tuple[str, str, int], str] = {}  # claimed sample -> session id
        self._ended: OrderedDict[str, SessionEnd] = OrderedDict()
        self._adhoc_lock = asyncio.Lock()
        self._turn_end_ids = turn_end_token_ids(tokenizer)
        self._maintenance: asyncio.Task[None] | None = None
        self._closed = False
        self.counts = {"opened": 0, "finished": 0, "failed": 0, "discarded": 0}

    @property
    def num_open(self) -> int:
        return len(self._sessions)

    async def start(self) -> None:
        await asyncio.to_thread(self._tq.create_partition, self.config.partition)
        self._maintenance = asyncio.create_task(self._maintain(), name="agent-sessions")

    async def close(self) -> None:
        """Shutdown: sessions still open are aborted (failed as infra, or discarded)."""
        self._closed = True
        if self._maintenance is not None:
            self._maintenance.cancel()
            await asyncio.gather(self._maintenance, return_exceptions=True)
        for session_id in list(self._sessions):
            with contextlib.suppress(AgentError):
                await self.abort(session_id, "the gateway shut down")

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self, spec: SessionSpec) -> AgentSession:
        if self._closed:
            raise AgentError(ErrorKind.UNAVAILABLE, "the gateway is shutting down")
        if len(self._sessions) >= self.config.max_sessions:
            raise AgentError(
                ErrorKind.TOO_MANY,
                f"{len(self._sessions)} sessions are open (agent_http.max_sessions); close some",
            )
        session_id = uuid.uuid4().hex
        spec = self._checked_spec(spec, session_id)
        session = AgentSession(
            session_id, spec, StickySession(self._pool, session_id, self._request_timeout_s)
        )
        if spec.claim_id:
            sample = (spec.partition, spec.uid, spec.index)
            if sample in self._samples:
                raise AgentError(
                    ErrorKind.CONFLICT,
                    f"sample {spec.uid}_{spec.index} already has open session "
                    f"{self._samples[sample]}",
                )
            self._samples[sample] = session_id  # reserved while the claim is checked
            try:
                session.group = await asyncio.to_thread(self._check_claimed_sample, spec)
            except BaseException:
                self._samples.pop(sample, None)
                raise
        self._sessions[session_id] = session
        self.counts["opened"] += 1
        logger.info(
            "agent session %s opened for %s/%s (%s)",
            session_id,
            spec.partition,
            session.trajectory_key,
            "claimed group" if spec.claim_id else "ad-hoc group",
        )
        return session

    def _checked_spec(self, spec: SessionSpec, session_id: str) -> SessionSpec:
        def invalid(message: str, param: str) -> AgentError:
            return AgentError(ErrorKind.INVALID, message, param=param)

        if not spec.uid:
            if spec.index or spec.claim_id:
                raise invalid("index and claim_id need the uid of the claimed group", "uid")
            return SessionSpec(
                partition=self._partition(spec.partition or self.config.partition),
                uid=f"agent-{session_id}",
                index=0,
                data_source=spec.data_source,
                ground_truth=spec.ground_truth,
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
            partition=self._partition(spec.partition),
            uid=spec.uid,
            index=spec.index,
            claim_id=spec.claim_id,
        )

    @staticmethod
    def _partition(name: str) -> str:
        from relayrl.tq.codec import check_partition_name

        try:
            return check_partition_name(name)
        except InvalidInputError as exc:
            raise AgentError(ErrorKind.INVALID, str(exc), param="partition") from None

    def _check_claimed_sample(self, spec: SessionSpec) -> common_pb2.PromptGroup:
        """The claimed group, once its claim is known to hold (it is renewed on the way)."""
        where = f"{spec.partition}/{spec.uid}"
        try:
            (entry,) = self._tq.get_groups(spec.partition, [spec.uid])
            self._tq.renew_leases(spec.partition, {spec.uid: spec.claim_id}, self._lease_s)
        except UnknownKeyError as exc:
            raise AgentError(ErrorKind.NOT_FOUND, str(exc), param="uid") from None
        except InvalidInputError as exc:  # unknown partition
            raise AgentError(ErrorKind.INVALID, str(exc), param="partition") from None
        except StaleClaimError:
            raise AgentError(
                ErrorKind.CONFLICT,
                f"{where}: claim {spec.claim_id!r} is not the group's current claim "
                "(released, expired, or another claimer's)",
                param="claim_id",
            ) from None
        except TQError as exc:
            raise AgentError(ErrorKind.UNAVAILABLE, f"TransferQueue: {exc}") from None
        group = entry.group
        if spec.index >= group.num_samples:
            raise AgentError(
                ErrorKind.INVALID,
                f"{where} has {group.num_samples} samples; index {spec.index} is out of range",
                param="index",
            )
        if any(t.index == spec.index for t in entry.trajectories):
            raise AgentError(
                ErrorKind.CONFLICT, f"{where}: sample {spec.index} already has a trajectory"
            )
        return group

    def get(self, session_id: str) -> AgentSession:
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        ended = self._ended.get(session_id)
        if ended is not None:
            how = "closed" if ended.outcome == "finished" else f"ended ({ended.outcome})"
            detail = f": {ended.reason}" if ended.reason else ""
            raise AgentError(ErrorKind.ENDED, f"session {session_id} was {how}{detail}")
        raise AgentError(
            ErrorKind.NOT_FOUND,
            f"unknown session {session_id!r}: open one with POST /sessions (or OpenSession)",
            code="session_not_found",
        )

    async def close_session(self, session_id: str) -> SessionEnd:
        """Put the trajectory as finished (or discard a session that generated nothing).
        Closing an ended session again returns how it ended."""
        if session_id in self._ended:
            return self._ended[session_id]
        session = self.get(session_id)
        if session.inflight is not None:
            raise AgentError(
                ErrorKind.CONFLICT,
                f"session {session_id} has a request in flight; close it once answered "
                "(or abort it)",
            )
        if not len(session.response):
            return self._forget(session, session.end("discarded", "closed before any generation"))
        return await self._put(session, failed=False, reason="")

    async def abort(self, session_id: str, reason: str) -> SessionEnd:
        """Put the trajectory as failed (is_infra) with `reason`; discard a session that
        generated nothing. A request in flight is cancelled."""
        if session_id in self._ended:
            return self._ended[session_id]
        session = self.get(session_id)
        reason = reason or "aborted by the caller"
        session.abort_reason = reason
        if session.inflight is not None:
            # Only the engine call is cancelled; a turn past it is recorded first.
            if session.generating is not None:
                session.generating.cancel()
            await asyncio.wait({session.inflight})
        if session_id in self._ended:  # ended meanwhile
            return self._ended[session_id]
        if not len(session.response):
            return self._forget(session, session.end("discarded", reason))
        return await self._put(session, failed=True, reason=reason)

    async def _put(self, session: AgentSession, *, failed: bool, reason: str) -> SessionEnd:
        if session.ending:
            raise AgentError(ErrorKind.CONFLICT, f"session {session.session_id} is ending")
        assert session.group is not None, "a session with generated tokens has its group"
        session.ending = True
        trajectory = self._trajectory(session, failed, reason)
        put = TrajectoryPut(trajectory, session.claim_id, failed=failed)
        try:
            await asyncio.to_thread(self._tq.put_trajectories, session.partition, [put])
        except (StaleClaimError, ConflictError, InvalidInputError) as exc:
            # Permanent: another claimer owns the group, the key holds another trajectory, or
            # the TransferQueue refuses this one (e.g. too large).
            why = f"the trajectory could not be written: {exc}"
            self._forget(session, session.end("discarded", why))
            kind = ErrorKind.INVALID if isinstance(exc, InvalidInputError) else ErrorKind.CONFLICT
            raise AgentError(kind, why) from None
        except TQError as exc:
            session.ending = False
            raise AgentError(
                ErrorKind.UNAVAILABLE, f"TransferQueue: {exc}; the session stays, retry"
            ) from None
        outcome: Outcome = "failed" if failed else "finished"
        logger.info(
            "agent session %s %s: %s, %d turns, %d response tokens%s",
            session.session_id,
            outcome,
            session.trajectory_key,
            session.num_turns,
            len(session.response),
            f" ({reason})" if reason else "",
        )
        return self._forget(session, session.end(outcome, reason))

    def _trajectory(
        self, session: AgentSession, failed: bool, reason: str
    ) -> common_pb2.Trajectory:
        assert session.group is not None
        rollout = session.response.build(
            session.prompt,
            self.tokenizer,
            session.finish_reason or "stop",
            session.num_turns,
            generate_s=session.generate_s,
            tool_s=session.agent_s,  # the agent's time between answers: its tools, its logic
        )
        trajectory = trajectory_of(session.group, session.index, rollout, session.opened_at)
        trajectory.labels[SESSION_LABEL] = session.session_id
        if failed:
            trajectory.finish_reason = "error"
            trajectory.error = reason[:2000]
        return trajectory

    def _forget(self, session: AgentSession, end: SessionEnd) -> SessionEnd:
        self._sessions.pop(session.session_id, None)
        self._samples.pop((session.partition, session.uid, session.index), None)
        self._pool.end_session(session.session_id)
        self._ended[session.session_id] = end
        while len(self._ended) > MAX_ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self.counts[end.outcome] += 1
        return end

    # -- turns ---------------------------------------------------------------------------

    async def chat(self, session_id: str, request: ChatRequest) -> TurnResult:
        session = self._ready(session_id, "chat")
        if session.last_result is not None and session.last_fingerprint == request.fingerprint():
            return session.last_result
        return await self._turn(session, self._plan_chat(session, request))

    async def complete(self, session_id: str, request: CompletionRequest) -> TurnResult:
        session = self._ready(session_id, "completion")
        if session.last_result is not None and session.last_fingerprint == request.fingerprint():
            return session.last_result
        return await self._turn(session, self._plan_completion(session, request))

    def _ready(self, session_id: str, kind: Literal["chat", "completion"]) -> AgentSession:
        session = self.get(session_id)
        if session.ending:
            raise AgentError(ErrorKind.CONFLICT, f"session {session_id} is ending")
        if session.inflight is not None:
            raise AgentError(
                ErrorKind.CONFLICT,
                f"session {session_id} already has a request in flight; a session is one "
                "conversation, one request at a time",
                code="request_in_flight",
            )
        if session.kind not in (None, kind):
            raise AgentError(
                ErrorKind.CONFLICT,
                f"session {session_id} is a {session.kind} session; it cannot take {kind} requests",
            )
        return session

    def _check_request(self, sampling: TurnSampling) -> tuple[int, ...]:
        """What is wrong with the request itself comes before how it fits the session; returns
        the stop strings as token ids."""
        limit = self.config.max_tokens
        if sampling.max_tokens is not None and sampling.max_tokens > limit:
            raise AgentError(
                ErrorKind.INVALID,
                f"max_tokens {sampling.max_tokens} is over the gateway's limit of {limit} "
                "(agent_http.max_tokens)",
                param="max_tokens",
            )
        return _stop_token_ids(self.tokenizer, sampling.stop)

    def _plan_chat(self, session: AgentSession, request: ChatRequest) -> _Plan:
        stops = self._turn_end_ids + self._check_request(request.sampling)
        tools = request.tools or None
        if session.num_turns == 0:
            prompt_text = render_chat(self.tokenizer, request.messages, tools, True)
            prompt, observation = encode(self.tokenizer, prompt_text), []
        else:
            if _fingerprint(tools) != _fingerprint(session.tools):
                raise _diverged("the tools differ from the first request's")
            new = self._new_messages(session, request.messages)
            observation = appended_token_ids(self.tokenizer, new, session.last_generated_id, tools)
            prompt = session.prompt + session.response.token_ids + observation
        return _Plan(
            engine_prompt=prompt,
            observation=observation,
            sampling=self._sampling(session, request.sampling, len(observation), stops),
            fingerprint=request.fingerprint(),
            messages=list(request.messages),
            tools=tools,
            parse_tool_calls=request.parse_tool_calls and bool(tools),
        )

    @staticmethod
    def _new_messages(
        session: AgentSession, messages: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        history = session.history
        if len(messages) < len(history):
            raise _diverged(
                f"the request has {len(messages)} messages, fewer than the {len(history)} of "
                "the conversation so far"
            )
        for position, recorded in enumerate(history):
            if _message_key(messages[position]) != _message_key(recorded):
                what = (
                    "the assistant reply the gateway returned"
                    if recorded["role"] == "assistant"
                    else f"the recorded {recorded['role']} message"
                )
                raise _diverged(f"messages[{position}] is not {what}")
        new = messages[len(history) :]
        if not new:
            raise AgentError(
                ErrorKind.CONFLICT,
                "the request adds no message after the assistant's last reply; append the "
                "tool results or the next user turn",
                code="conversation_diverged",
            )
        return new

    def _plan_completion(self, session: AgentSession, request: CompletionRequest) -> _Plan:
        stops = self._check_request(request.sampling)
        recorded = session.prompt + session.response.token_ids
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if session.num_turns and ids[: len(recorded)] != recorded:
                raise _diverged("prompt token ids do not start with the session's tokens")
            new_ids = ids[len(recorded) :] if session.num_turns else []
            prompt = ids
        else:
            text = request.prompt_text or ""
            if session.num_turns:
                if session.text is None or not text.startswith(session.text):
                    raise _diverged(
                        "the prompt does not start with the previous prompt and the text "
                        "returned for it"
                    )
                new_ids = encode(self.tokenizer, text[len(session.text) :])
                prompt = recorded + new_ids
            else:
                new_ids, prompt = [], encode(self.tokenizer, text)
        if not prompt:
            raise AgentError(ErrorKind.INVALID, "the prompt is empty", param="prompt")
        return _Plan(
            engine_prompt=prompt,
            observation=new_ids,
            sampling=self._sampling(session, request.sampling, len(new_ids), stops),
            fingerprint=request.fingerprint(),
            prompt_text=request.prompt_text,
        )

    def _sampling(
        self,
        session: AgentSession,
        requested: TurnSampling,
        num_observation_tokens: int,
        stop_token_ids: tuple[int, ...],
    ) -> SamplingOptions:
        left = self.config.max_response_tokens - len(session.response) - num_observation_tokens
        if left < 1:
            raise AgentError(
                ErrorKind.INVALID,
                f"the session's budget of {self.config.max_response_tokens} response tokens "
                "(agent_http.max_response_tokens) is used up; close the session",
                param="max_tokens",
                code="context_length_exceeded",
            )
        # A claimed group's SamplingParams fill what the request leaves out; otherwise
        # OpenAI's defaults (temperature 1, top_p 1, no top-k).
        claimed = session.group is not None and session.spec.claim_id
        group = session.group.sampling if claimed else None
        temperature = requested.temperature
        if temperature is None:
            temperature = group.temperature if group is not None else 1.0
        top_k = requested.top_k
        if top_k is None:
            top_k = group.top_k if group is not None and group.top_k > 0 else -1
        try:
            return SamplingOptions(
                max_tokens=min(requested.max_tokens or self.config.default_max_tokens, left),
                temperature=temperature,
                top_p=requested.top_p or (group.top_p if group is not None else 0) or 1.0,
                top_k=top_k,
                seed=requested.seed,
                stop_token_ids=tuple(dict.fromkeys(stop_token_ids)),
                structured_outputs=requested.structured_outputs,
            )
        except ValueError as exc:
            raise AgentError(ErrorKind.INVALID, str(exc)) from None

    async def _turn(self, session: AgentSession, plan: _Plan) -> TurnResult:
        """Generate and record, one request per session at a time. The turn runs on even if
        the caller goes away (its retry then gets the recorded answer back)."""
        task = asyncio.ensure_future(self._generate_and_record(session, plan))
        session.inflight = task

        def settled(_: asyncio.Task[TurnResult]) -> None:
            session.inflight = None
            session.last_active = time.monotonic()

        task.add_done_callback(settled)
        return await asyncio.shield(task)

    async def _generate_and_record(self, session: AgentSession, plan: _Plan) -> TurnResult:
        started = time.monotonic()
        if session.answered_at is not None:
            session.agent_s += started - session.answered_at
            session.answered_at = None
        session.generating = asyncio.ensure_future(self._generate(session, plan))
        try:
            generation = await session.generating
        except asyncio.CancelledError:
            if not session.abort_reason:
                raise
            raise AgentError(
                ErrorKind.ENDED,
                f"session {session.session_id} was aborted during the request: "
                f"{session.abort_reason}",
            ) from None
        finally:
            session.generating = None
        session.generate_s += time.monotonic() - started
        if session.session_id not in self._sessions:
            raise AgentError(ErrorKind.ENDED, f"session {session.session_id} ended meanwhile")
        if session.group is None:
            group = self._adhoc_group(session, plan)
            session.claim_id = await self._claim_adhoc(group)
            session.group = group
        return self._record(session, plan, generation)

    async def _generate(self, session: AgentSession, plan: _Plan) -> Generation:
        try:
            return await session.engine.generate(plan.engine_prompt, plan.sampling)
        except EngineRejected as exc:
            raise AgentError(ErrorKind.INVALID, f"the engine refused the request: {exc}") from None
        except (EngineError, EngineTimeout) as exc:
            raise AgentError(
                ErrorKind.ENGINE,
                f"{type(exc).__name__}: {exc}; nothing was recorded, the session stays: send "
                "the request again or abort the session",
            ) from None
        except (NoReplicaAvailable, TimeoutError) as exc:
            detail = str(exc) or f"no replica became routable in {self._request_timeout_s} s"
            raise AgentError(
                ErrorKind.UNAVAILABLE,
                f"no engine replica is serving ({detail}); nothing was recorded, retry later",
            ) from None

    def _adhoc_group(self, session: AgentSession, plan: _Plan) -> common_pb2.PromptGroup:
        spec, sampling = session.spec, plan.sampling
        return common_pb2.PromptGroup(
            uid=session.uid,
            partition=session.partition,
            prompt_step=self._policy_step(),
            num_samples=1,
            prompt_token_ids=plan.engine_prompt,
            data_source=spec.data_source,
            ground_truth=spec.ground_truth,
            agent=AGENT_LOOP_NAME,
            labels=dict(spec.labels),
            sampling=common_pb2.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),
                max_response_tokens=self.config.max_response_tokens,
            ),
        )

    async def _claim_adhoc(self, group: common_pb2.PromptGroup) -> str:
        async with self._adhoc_lock:  # this gateway's own ad-hoc groups never pass each other
            try:
                return await asyncio.to_thread(
                    claim_group_by_uid,
                    self._tq,
                    group,
                    claimer=self._claimer,
                    lease_s=self._lease_s,
                )
            except ConflictError as exc:
                raise AgentError(ErrorKind.CONFLICT, str(exc)) from None
            except TQError as exc:
                raise AgentError(
                    ErrorKind.UNAVAILABLE,
                    f"TransferQueue: {exc}; nothing was recorded, send the request again",
                ) from None

    def _record(self, session: AgentSession, plan: _Plan, generation: Generation) -> TurnResult:
        turn = session.num_turns
        if turn == 0:
            session.prompt = list(plan.engine_prompt)
            session.kind = "chat" if plan.messages is not None else "completion"
            session.tools = plan.tools
        else:
            session.response.add_observation(plan.observation, turn - 1)
        offset = len(session.response)
        session.response.add_generation(generation, turn, session.engine.replica_id)
        session.num_turns = turn + 1
        session.finish_reason = generation.finish_reason
        session.last_generated_id = generation.token_ids[-1] if generation.token_ids else None
        text = self.tokenizer.decode(list(generation.token_ids), skip_special_tokens=True)
        result = TurnResult(
            session_id=session.session_id,
            turn=turn,
            created=int(time.time()),
            prompt_token_ids=tuple(plan.engine_prompt),
            token_ids=generation.token_ids,
            logprobs=generation.logprobs,
            text=text,
            finish_reason=_openai_finish_reason(generation.finish_reason),
            replica_id=session.engine.replica_id,
            version_spans=tuple(
                (span.policy_version, span.start - offset, span.end - offset)
                for span in session.response.spans
                if span.generated and span.start >= offset
            ),
        )
        if plan.messages is not None:
            result = self._as_chat_reply(session, plan, result)
        else:  # the text history is known while the agent sends text
            session.text = plan.prompt_text + text if plan.prompt_text is not None else None
        session.last_fingerprint, session.last_result = plan.fingerprint, result
        session.answered_at = time.monotonic()
        return result

    def _as_chat_reply(self, session: AgentSession, plan: _Plan, result: TurnResult) -> TurnResult:
        content: str | None = result.text
        tool_calls: list[dict[str, Any]] = []
        if plan.parse_tool_calls:
            calls = [call for call in parse_tool_calls(result.text) if call.error is None]
            for number, call in enumerate(calls):
                tool_calls.append(
                    {
                        "id": f"call-{session.session_id[:12]}-{result.turn}-{number}",
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                    }
                )
            if tool_calls:
                content = result.text[: result.text.index(TOOL_CALL_OPEN)].strip() or None
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        session.history = [*(plan.messages or []), reply]
        finish = result.finish_reason
        if tool_calls and finish == "stop":
            finish = "tool_calls"
        return dataclasses.replace(
            result, content=content, tool_calls=tuple(tool_calls), finish_reason=finish
        )

    # -- upkeep --------------------------------------------------------------------------

    async def _maintain(self) -> None:
        """Renew the claims of open sessions; abort idle ones and ones whose claim was lost."""
        interval_s = max(0.05, min(self._lease_s / 3, self.config.session_idle_timeout_s / 4, 5.0))
        renew_every_s = self._lease_s / 3
        last_renewal = time.monotonic()
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            try:
                await self._abort_idle(now)
                if now - last_renewal >= renew_every_s:
                    last_renewal = now
                    await self._renew_claims()
            except Exception:  # a bug here must not stop the upkeep of every other session
                logger.exception("agent session upkeep failed; trying again")

    async def _abort_idle(self, now: float) -> None:
        idle_s = self.config.session_idle_timeout_s
        for session in list(self._sessions.values()):
            busy = session.inflight is not None or session.ending
            if not busy and now - session.last_active > idle_s:
                await self._abort_quietly(session, f"idle for more than {idle_s:g} s")

    async def _renew_claims(self) -> None:
        for session in list(self._sessions.values()):
            if not session.claim_id or session.ending:
                continue
            try:
                await asyncio.to_thread(
                    self._tq.renew_leases,
                    session.partition,
                    {session.uid: session.claim_id},
                    self._lease_s,
                )
            except StaleClaimError:
                reason = f"the claim on {session.partition}/{session.uid} was lost"
                logger.warning("agent session %s: %s; ending it", session.session_id, reason)
                session.abort_reason = reason
                if session.generating is not None:
                    session.generating.cancel()
                self._forget(session, session.end("discarded", reason))
            except TQError as exc:
                logger.warning("renewing %s failed: %s", session.trajectory_key, exc)

    async def _abort_quietly(self, session: AgentSession, reason: str) -> None:
        try:
            end = await self.abort(session.session_id, reason)
        except AgentError as exc:
            logger.warning("aborting agent session %s failed: %s", session.session_id, exc)
            return
        logger.info("agent session %s aborted: %s (%s)", session.session_id, reason, end.outcome)


def _diverged(detail: str) -> AgentError:
    return AgentError(
        ErrorKind.CONFLICT,
        f"the request does not extend the session's conversation: {detail}. The gateway "
        "records the tokens the policy saw; an agent that edits earlier turns opens a new "
        "session for the new context",
        param="messages",
        code="conversation_diverged",
    )


def _openai_finish_reason(engine_reason: str) -> str:
    return engine_reason if engine_reason in ("stop", "length") else "stop"


def claim_group_by_uid(
    tq: TransferQueue, group: common_pb2.PromptGroup, *, claimer: str, lease_s: float
) -> str:
    """Put `group` as pending and claim it; returns the claim id. The TransferQueue claims
    the oldest pending groups first, so groups ahead of this one are claimed on the way and
    given back (released to pending) at once."""
    partition = group.partition
    tq.put_groups(partition, [group])
    passed: list[ClaimedGroup] = []
    try:
        while len(passed) <= MAX_PASSED_GROUPS:
            claimed = tq.claim_groups(
                partition, max_groups=1, claimer=claimer, lease_s=lease_s
            ).claimed
            if not claimed:
                break
            if claimed[0].group.uid == group.uid:
                return claimed[0].claim_id
            passed.append(claimed[0])
    finally:
        if passed:
            tq.release_groups(
                partition, passed, f"passed over while claiming agent group {group.uid}"
            )
    raise TQError(
        f"could not claim agent group {partition}/{group.uid}: "
        + (
            f"more than {MAX_PASSED_GROUPS} pending groups lie ahead of it; give agent "
            "sessions a partition of their own (agent_http.partition)"
            if passed
            else "it is not pending (another claimer took it)"
        )
    )
