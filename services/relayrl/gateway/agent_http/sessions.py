"""Every open agent session of a gateway: opening and ending them, serving their turns, and the
upkeep that renews their claims and aborts idle ones.

A turn: the request kind's conversation strategy plans it (`conversations`), the engine
generates on the session's sticky replica (request id = session id, so every turn hits the
replica whose prefix cache holds the conversation), and the session records it. The same
request sent again (a client retry after a lost answer) gets the recorded answer back without
generating again. Engine failures do not end a session: the failed generation is not recorded,
the agent gets 502 (engine error or timeout) or 503 (no replica serving, e.g. during a weight
update) and may send the same request again; whoever drives the agent aborts the session if it
gives up.

Ending a session: close puts the trajectory as finished (the reward-service scores it); abort
puts it as failed (is_infra) with the reason, and a session in which nothing was generated is
discarded (nothing written; a caller that claimed the group keeps its claim). An agent that
exits 0 without closing ends its session as a close, unless that ending is the
infrastructure's (`end_on_exit`). Sessions idle for
`session_idle_timeout_s` are aborted; a claim lost while the session runs ends it (nothing
can be written under it any more)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relayrl.core.env_reward import EnvReward
from relayrl.gateway.agent_http.access import SessionTokens
from relayrl.gateway.agent_http.conversations import Conversation, TurnPlan, build_conversations
from relayrl.gateway.agent_http.domain import (
    ChatRequest,
    CompletionRequest,
    Outcome,
    SessionEnd,
    SessionKind,
    SessionSpec,
    TurnRequest,
    TurnResult,
    checked_spec,
)
from relayrl.gateway.agent_http.errors import DIVERGED, AgentError, ErrorKind
from relayrl.gateway.agent_http.session import AgentSession, Answered
from relayrl.gateway.agent_http.store import AgentGroupStore, TrajectoryRefused
from relayrl.gateway.config import AgentHttpConfig
from relayrl.gateway.engine_session import EngineTimeout, StickySession
from relayrl.gateway.replicas import NoReplicaAvailable, ReplicaPool
from relayrl.inference.client import (
    EngineError,
    EngineRejected,
    Generation,
    text_before_stop,
)
from relayrl.tq import AsyncTransferQueue
from relayrl.tq.errors import TQError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_ENDED_REMEMBERED = 4096
# A request that failed with one of these failed on our side, not the agent's.
INFRASTRUCTURE_ERRORS = frozenset({ErrorKind.ENGINE, ErrorKind.UNAVAILABLE})


@dataclass(frozen=True)
class Answering:
    """A request being answered: its strategy, its planned turn, its fingerprint."""

    conversation: Conversation[Any]
    plan: TurnPlan[Any]
    fingerprint: str


class AgentSessions:
    """Every open agent session of this gateway, and what their requests do."""

    def __init__(
        self,
        *,
        tq: AsyncTransferQueue,
        pool: ReplicaPool,
        tokenizer: PreTrainedTokenizerBase,
        config: AgentHttpConfig,
        claimer: str,
        lease_s: float,
        request_timeout_s: float,
        policy_step: Callable[[], int] = lambda: 0,
    ) -> None:
        self._pool = pool
        self.tokenizer = tokenizer
        self.config = config
        self._request_timeout_s = request_timeout_s
        self._store = AgentGroupStore(
            tq,
            claimer=claimer,
            lease_s=lease_s,
            max_response_tokens=config.max_response_tokens,
            policy_step=policy_step,
        )
        self._conversations = build_conversations(tokenizer, config)
        self._sessions: dict[str, AgentSession] = {}
        self._samples: dict[tuple[str, str, int], str] = {}  # claimed sample -> session id
        self._ended: OrderedDict[str, SessionEnd] = OrderedDict()
        self._maintenance: asyncio.Task[None] | None = None
        self._closed = False
        self.counts = {"opened": 0, "finished": 0, "failed": 0, "discarded": 0}
        self.tokens = SessionTokens()  # each session's own bearer token (agent_http.access)

    @property
    def num_open(self) -> int:
        return len(self._sessions)

    async def start(self) -> None:
        await self._store.create_partition(self.config.partition)
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

    async def open_for_caller(self, spec: SessionSpec) -> AgentSession:
        """`open` for a caller of the endpoint (HTTP or gRPC): only on the partitions
        `agent_http.open_partitions` lists, so that no caller writes ad-hoc groups into, or
        opens sessions on the claims of, a partition the trainer reads. The gateway's own
        external agents open theirs with `open`."""
        if not spec.uid and not self.config.adhoc_sessions:
            raise AgentError(
                ErrorKind.FORBIDDEN,
                "ad-hoc sessions are off on this gateway (agent_http.adhoc_sessions): a "
                "session that names no claimed group makes a group of one sample, which GRPO "
                "cannot train; run the agent through the gateway (agents.external) so that it "
                "rolls out claimed groups of n",
                param="uid",
            )
        partition = spec.partition or self.config.partition
        allowed = self.config.open_partitions or [self.config.partition]
        if partition not in allowed:
            raise AgentError(
                ErrorKind.FORBIDDEN,
                f"partition {partition!r} is not open to agents (agent_http.open_partitions: "
                f"{allowed})",
                param="partition",
            )
        return await self.open(spec)

    async def open(self, spec: SessionSpec) -> AgentSession:
        if self._closed:
            raise AgentError(ErrorKind.UNAVAILABLE, "the gateway is shutting down")
        if len(self._sessions) >= self.config.max_sessions:
            raise AgentError(
                ErrorKind.TOO_MANY,
                f"{len(self._sessions)} sessions are open (agent_http.max_sessions); close some",
            )
        session_id = uuid.uuid4().hex
        spec = checked_spec(spec, session_id, self.config.partition)
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
                session.claim.group = await self._store.claimed_group(spec)
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

    def ended(self, session_id: str) -> SessionEnd | None:
        """How a session ended (None while it is open, or long forgotten)."""
        return self._ended.get(session_id)

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

    async def close_session(
        self, session_id: str, env_reward: EnvReward | None = None
    ) -> SessionEnd:
        """Put the trajectory as finished (or discard a session that generated nothing), with
        the environment's reward when the agent reports one. Closing an ended session again
        returns how it ended."""
        if session_id in self._ended:
            return self._ended[session_id]
        session = self.get(session_id)
        if session.activity.busy:
            raise AgentError(
                ErrorKind.CONFLICT,
                f"session {session_id} has a request in flight; close it once answered "
                "(or abort it)",
            )
        if not session.num_response_tokens:
            reason = "closed before any generation"
            if env_reward is not None and env_reward.status != "ok":  # the environment's why
                reason += f"; its environment reported {env_reward.status}: {env_reward.message}"
            return self._forget(session, session.end("discarded", reason))
        return await self._put(session, failed=False, reason="", env_reward=env_reward)

    async def end_on_exit(self, session_id: str, who: str) -> SessionEnd:
        """The agent driving the session is done with it (its process exited 0, its served
        task reported success) without closing it: the episode is over, and its trajectory is
        what the policy generated. It is closed without an environment reward, unless the
        ending is the infrastructure's: nothing was generated (discarded), a request is still
        being answered, or the last request failed on our side (aborted, failed as infra).
        `who` says who ended it, for the reason ("agent 'x' exited 0")."""
        if session_id in self._ended:
            return self._ended[session_id]
        session = self.get(session_id)
        activity = session.activity
        if activity.busy:
            reason = f"{who} while its request was still being answered"
        elif not session.num_response_tokens:
            reason = f"{who} with no generation"
        elif activity.last_failure:
            reason = f"{who} after its last request failed: {activity.last_failure}"
        else:
            return await self.close_session(session_id)
        return await self.abort(session_id, reason)

    async def abort(self, session_id: str, reason: str) -> SessionEnd:
        """Put the trajectory as failed (is_infra) with `reason`; discard a session that
        generated nothing. A request in flight is cancelled."""
        if session_id in self._ended:
            return self._ended[session_id]
        session = self.get(session_id)
        reason = reason or "aborted by the caller"
        activity = session.activity
        activity.abort_reason = reason
        if activity.inflight is not None:
            # Only the engine call is cancelled; a turn past it is recorded first.
            if activity.generating is not None:
                activity.generating.cancel()
            await asyncio.wait({activity.inflight})
        if session_id in self._ended:  # ended meanwhile
            return self._ended[session_id]
        if not session.num_response_tokens:
            return self._forget(session, session.end("discarded", reason))
        return await self._put(session, failed=True, reason=reason)

    async def _put(
        self,
        session: AgentSession,
        *,
        failed: bool,
        reason: str,
        env_reward: EnvReward | None = None,
    ) -> SessionEnd:
        activity = session.activity
        if activity.ending:
            raise AgentError(ErrorKind.CONFLICT, f"session {session.session_id} is ending")
        activity.ending = True
        trajectory = session.trajectory(
            self.tokenizer, failed=failed, reason=reason, env_reward=env_reward
        )
        try:
            await self._store.put(
                session.partition, trajectory, session.claim.claim_id, failed=failed
            )
        except TrajectoryRefused as exc:
            self._forget(session, session.end("discarded", exc.message))
            raise
        except AgentError:
            activity.ending = False
            raise
        outcome: Outcome = "failed" if failed else "finished"
        logger.info(
            "agent session %s %s: %s, %d turns, %d response tokens%s",
            session.session_id,
            outcome,
            session.trajectory_key,
            session.num_turns,
            session.num_response_tokens,
            f" ({reason})" if reason else "",
        )
        return self._forget(session, session.end(outcome, reason))

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
        return await self.turn(session_id, request)

    async def complete(self, session_id: str, request: CompletionRequest) -> TurnResult:
        return await self.turn(session_id, request)

    async def turn(self, session_id: str, request: TurnRequest) -> TurnResult:
        """Serve one request of the session with its kind's conversation strategy."""
        conversation = self._conversations[request.kind]
        session = self._ready(session_id, conversation.session_kind)
        key = request.fingerprint()
        answered = session.dialogue.last_answer
        if answered is not None and answered.fingerprint == key:
            return answered.result
        try:
            plan = self._plan(session, conversation, request)
            result = await self._turn(session, Answering(conversation, plan, key))
        except AgentError as exc:
            if exc.kind in INFRASTRUCTURE_ERRORS:
                session.activity.last_failure = exc.message
            raise
        except Exception as exc:
            session.activity.last_failure = f"the gateway failed: {type(exc).__name__}: {exc}"
            raise
        session.activity.last_failure = ""
        return result

    def _plan(
        self, session: AgentSession, conversation: Conversation[Any], request: TurnRequest
    ) -> TurnPlan[Any]:
        """The turn, planned on the segment the request extends (the most recently used
        first), or on a new segment when it extends none (agent_http.segments)."""
        diverged: AgentError | None = None
        for segment in session.candidates():
            session.current = segment
            try:
                return conversation.plan(session, request)
            except AgentError as exc:
                if exc.code != DIVERGED:
                    raise
                diverged = diverged or exc
        if diverged is not None and not self.config.segments:
            raise diverged
        session.start_segment()
        return conversation.plan(session, request)

    def _ready(self, session_id: str, kind: SessionKind) -> AgentSession:
        session = self.get(session_id)
        if session.activity.ending:
            raise AgentError(ErrorKind.CONFLICT, f"session {session_id} is ending")
        if session.activity.busy:
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

    async def _turn(self, session: AgentSession, answering: Answering) -> TurnResult:
        """Generate and record, one request per session at a time. The turn runs on even if
        the caller goes away (its retry then gets the recorded answer back)."""
        task = asyncio.ensure_future(self._generate_and_record(session, answering))
        session.activity.inflight = task

        def settled(_: asyncio.Task[TurnResult]) -> None:
            session.activity.inflight = None
            session.clock.last_active = time.monotonic()

        task.add_done_callback(settled)
        return await asyncio.shield(task)

    async def _generate_and_record(self, session: AgentSession, answering: Answering) -> TurnResult:
        activity, plan = session.activity, answering.plan
        started = session.clock.turn_started()
        activity.generating = asyncio.ensure_future(self._generate(session, plan))
        try:
            generation = await activity.generating
        except asyncio.CancelledError:
            if not activity.abort_reason:
                raise
            raise AgentError(
                ErrorKind.ENDED,
                f"session {session.session_id} was aborted during the request: "
                f"{activity.abort_reason}",
            ) from None
        finally:
            activity.generating = None
        session.clock.generate_s += time.monotonic() - started
        if session.session_id not in self._sessions:
            raise AgentError(ErrorKind.ENDED, f"session {session.session_id} ended meanwhile")
        if session.claim.group is None:
            group = self._store.adhoc_group(session.spec, plan.engine_prompt, plan.sampling)
            session.claim.claim_id = await self._store.claim_adhoc(group)
            session.claim.group = group
        return self._record(session, answering, generation)

    async def _generate(self, session: AgentSession, plan: TurnPlan[Any]) -> Generation:
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

    def _record(
        self, session: AgentSession, answering: Answering, generation: Generation
    ) -> TurnResult:
        plan, turn = answering.plan, session.num_turns
        if session.kind is None:
            session.kind = answering.conversation.session_kind
        replica_id = session.engine.replica_id
        spans = session.transcript.record(
            plan.engine_prompt, plan.observation, generation, replica_id
        )
        session.recorded()
        decoded = self.tokenizer.decode(list(generation.token_ids), skip_special_tokens=True)
        text, held_back = text_before_stop(
            decoded, generation.stop_string, plan.request.sampling.include_stop_str_in_output
        )
        result = TurnResult(
            session_id=session.session_id,
            turn=turn,
            created=int(time.time()),
            prompt_token_ids=tuple(plan.engine_prompt),
            token_ids=generation.token_ids,
            logprobs=generation.logprobs,
            text=text,
            finish_reason=_openai_finish_reason(generation.finish_reason),
            replica_id=replica_id,
            version_spans=spans,
            held_back=held_back,
            top_logprobs=generation.top_logprobs,
        )
        result = answering.conversation.answer(session, plan, result)
        session.dialogue.last_answer = Answered(answering.fingerprint, result)
        session.clock.answered_at = time.monotonic()
        return result

    # -- upkeep --------------------------------------------------------------------------

    async def _maintain(self) -> None:
        """Renew the claims of open sessions; abort idle ones and ones whose claim was lost."""
        lease_s = self._store.lease_s
        interval_s = max(0.05, min(lease_s / 3, self.config.session_idle_timeout_s / 4, 5.0))
        renew_every_s = lease_s / 3
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
            busy = session.activity.busy or session.activity.ending
            if not busy and now - session.clock.last_active > idle_s:
                await self._abort_quietly(session, f"idle for more than {idle_s:g} s")

    async def _renew_claims(self) -> None:
        for session in list(self._sessions.values()):
            claim_id = session.claim.claim_id
            if not claim_id or session.activity.ending:
                continue
            try:
                held = await self._store.renew(session.partition, session.uid, claim_id)
            except TQError as exc:
                logger.warning("renewing %s failed: %s", session.trajectory_key, exc)
                continue
            if not held:
                reason = f"the claim on {session.partition}/{session.uid} was lost"
                logger.warning("agent session %s: %s; ending it", session.session_id, reason)
                session.activity.abort_reason = reason
                if session.activity.generating is not None:
                    session.activity.generating.cancel()
                self._forget(session, session.end("discarded", reason))

    async def _abort_quietly(self, session: AgentSession, reason: str) -> None:
        try:
            end = await self.abort(session.session_id, reason)
        except AgentError as exc:
            logger.warning("aborting agent session %s failed: %s", session.session_id, exc)
            return
        logger.info("agent session %s aborted: %s (%s)", session.session_id, reason, end.outcome)


def _openai_finish_reason(engine_reason: str) -> str:
    return engine_reason if engine_reason in ("stop", "length") else "stop"
