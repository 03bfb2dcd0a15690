"""One agent session: one trajectory, its state kept in a few groups that change for different
reasons: the claim it writes under, its segments (each the tokens recorded and the
conversation as the agent sees it), its clock and what runs in it now.

A session is one sample. Most agents hold one conversation, so a session has one segment. An
agent whose request does not extend any conversation so far (it changed its tools, edited its
system prompt, rewrote its scratchpad, summarised its history) starts another segment of the
same sample (docs/architecture.md#segments)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relayrl.gateway.agent_http.domain import (
    Outcome,
    SessionEnd,
    SessionKind,
    SessionSpec,
    TurnResult,
)
from relayrl.gateway.agents import ResponseBuilder
from relayrl.gateway.engine_session import StickySession, trajectory_of
from relayrl.inference.client import Generation
from relayrl.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from relayrl.core.env_reward import EnvReward

SESSION_LABEL = "agent_session"


@dataclass
class Claim:
    """The group the trajectory goes into and the claim that lets this session write it."""

    # The claimed group (read at open), or the ad-hoc group once created.
    group: common_pb2.PromptGroup | None = None
    claim_id: str = ""


@dataclass
class Transcript:
    """The tokens recorded so far, what the trajectory is built from."""

    prompt: list[int] = field(default_factory=list)
    response: ResponseBuilder = field(default_factory=ResponseBuilder)
    num_turns: int = 0
    finish_reason: str = ""
    last_generated_id: int | None = None

    def token_ids(self) -> list[int]:
        return self.prompt + self.response.token_ids

    def record(
        self,
        engine_prompt: list[int],
        observation: list[int],
        generation: Generation,
        replica_id: str,
    ) -> tuple[tuple[int, int, int], ...]:
        """Append one turn (the observation before it, then the generated tokens); returns the
        turn's (version, start, end) spans over its generated tokens."""
        turn = self.num_turns
        if turn == 0:
            self.prompt = list(engine_prompt)
        else:
            self.response.add_observation(observation, turn - 1)
        offset = len(self.response)
        self.response.add_generation(generation, turn, replica_id)
        self.num_turns = turn + 1
        self.finish_reason = generation.finish_reason
        self.last_generated_id = generation.token_ids[-1] if generation.token_ids else None
        return tuple(
            (span.policy_version, span.start - offset, span.end - offset)
            for span in self.response.spans
            if span.generated and span.start >= offset
        )


@dataclass(frozen=True)
class Answered:
    """The last request answered: a client's retry of it gets the same answer back."""

    fingerprint: str
    result: TurnResult


@dataclass
class Dialogue:
    """The conversation as the agent sees it: the next request must extend it."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # incl. the replies returned
    tools: list[dict[str, Any]] | None = None
    text: str | None = None  # completions on text: prompt + returned texts
    held_back: str = ""  # the last answer's generated text not returned (its stop string)
    last_answer: Answered | None = None


@dataclass
class Clock:
    """Wall-clock and monotonic times of the session; the trajectory's timings."""

    opened_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    answered_at: float | None = None
    generate_s: float = 0.0
    agent_s: float = 0.0  # between an answer and the next request: the agent's tools, logic

    def turn_started(self) -> float:
        now = time.monotonic()
        if self.answered_at is not None:
            self.agent_s += now - self.answered_at
            self.answered_at = None
        return now


@dataclass
class Activity:
    """What runs in the session now: the request being served, and within it the engine call
    (what an abort cancels); whether its trajectory is being put."""

    inflight: asyncio.Task[TurnResult] | None = None
    generating: asyncio.Task[Generation] | None = None
    ending: bool = False
    abort_reason: str = ""
    # Why the last request failed on our side (the engine, no replica, the gateway); empty
    # once a request is answered. An agent that exits 0 right after such a failure has caught
    # it, and its episode is the infrastructure's failure, not an answer.
    last_failure: str = ""

    @property
    def busy(self) -> bool:
        return self.inflight is not None


@dataclass
class Segment:
    """One conversation of the session: its recorded tokens and what the agent was shown."""

    transcript: Transcript = field(default_factory=Transcript)
    dialogue: Dialogue = field(default_factory=Dialogue)
    last_turn: int = -1  # the session's turn that last generated in it


class AgentSession:
    def __init__(self, session_id: str, spec: SessionSpec, engine: StickySession) -> None:
        self.session_id = session_id
        self.spec = spec
        self.engine = engine
        self.claim = Claim(claim_id=spec.claim_id)
        self.kind: SessionKind | None = None  # fixed by the first request
        self.segments: list[Segment] = []  # those that generated, in the order they started
        self.current = Segment()  # the one the request being served extends
        self.clock = Clock()
        self.activity = Activity()

    @property
    def transcript(self) -> Transcript:
        return self.current.transcript

    @property
    def dialogue(self) -> Dialogue:
        return self.current.dialogue

    def candidates(self) -> list[Segment]:
        """The segments a request may extend, the most recently used first."""
        return sorted(self.segments, key=lambda segment: -segment.last_turn)

    def start_segment(self) -> None:
        """The request being served starts a new conversation (kept once it generates)."""
        self.current = Segment()

    def recorded(self) -> None:
        """The current segment generated the session's latest turn."""
        if self.current not in self.segments:
            self.segments.append(self.current)
        self.current.last_turn = self.num_turns - 1

    @property
    def num_response_tokens(self) -> int:
        return sum(len(segment.transcript.response) for segment in self.segments)

    @property
    def partition(self) -> str:
        return self.spec.partition

    @property
    def uid(self) -> str:
        return self.spec.uid

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def num_turns(self) -> int:
        return sum(segment.transcript.num_turns for segment in self.segments)

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
            num_prompt_tokens=sum(len(seg.transcript.prompt) for seg in self.segments),
            num_response_tokens=self.num_response_tokens,
            reason=reason,
        )

    def trajectory(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        failed: bool,
        reason: str,
        env_reward: EnvReward | None = None,
    ) -> common_pb2.Trajectory:
        group = self.claim.group
        assert group is not None, "a session with generated tokens has its group"
        # The segment that generated last holds the final answer: it fills the trajectory's
        # own fields, which rewards score; the others go along as its segments.
        last = max(self.segments, key=lambda segment: segment.last_turn)
        transcript = last.transcript
        rollout = transcript.response.build(
            transcript.prompt,
            tokenizer,
            transcript.finish_reason or "stop",
            self.num_turns,
            generate_s=self.clock.generate_s,
            tool_s=self.clock.agent_s,  # the agent's time between answers: its tools, its logic
        )
        trajectory = trajectory_of(group, self.index, rollout, self.clock.opened_at)
        for segment in self.segments:
            if segment is not last:
                response = segment.transcript.response
                trajectory.segments.add(
                    prompt_token_ids=segment.transcript.prompt,
                    response_token_ids=response.token_ids,
                    response_mask=bytes(response.mask),
                    rollout_logprobs=response.logprobs,
                    spans=response.spans,
                )
        trajectory.labels[SESSION_LABEL] = self.session_id
        if env_reward is not None:  # the one writer of a trajectory's environment reward
            trajectory.env_reward.CopyFrom(env_reward.to_proto())
        if failed:
            trajectory.finish_reason = "error"
            trajectory.error = reason[:2000]
        return trajectory
