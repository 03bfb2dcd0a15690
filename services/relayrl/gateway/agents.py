"""Agent loops: how one trajectory of a prompt group is rolled out on its engine session.

Built-ins (an explicit table, plus the operator's loops by dotted path):
- `single_turn`: one generation; the response is exactly the sampled tokens.
- `tool_agent`: generating -> calling tools -> generating ... -> done. Tool calls are parsed
  from the generated tokens (decoded only to be parsed); tool answers are appended as
  observation tokens rendered by the chat template's tool turn (response_mask 0); the next
  turn's prompt is the initial prompt + the response so far, token for token
  (docs/architecture.md#agent-loops: engine-returned ids are reused, never re-tokenised, so
  the trainer sees what was sampled).

How the trajectory relates to the chat template: `relayrl.conversation.rendering`.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from relayrl.conversation import rendering
from relayrl.conversation import tool_calls as tool_syntax
from relayrl.conversation.tools import ToolTable, error_message
from relayrl.core.dotted import import_object
from relayrl.inference.client import EngineClient, GenerateRequest, Generation, SamplingOptions
from relayrl.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

UNKNOWN_VERSION = -1

# --- engine session --------------------------------------------------------------------------


@runtime_checkable
class EngineSession(Protocol):
    """One trajectory's sticky engine: every turn of a rollout goes to the same replica."""

    replica_id: str

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions
    ) -> Generation: ...


class ClientSession:
    """An EngineSession on one EngineClient (tests, single-replica tools); the gateway's
    replica pool has its own sticky session. Request ids are `<session_id>-t<n>`."""

    def __init__(self, client: EngineClient, session_id: str) -> None:
        self.replica_id = client.name
        self._client = client
        self._session_id = session_id
        self._num_requests = 0

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions
    ) -> Generation:
        request_id = f"{self._session_id}-t{self._num_requests}"
        self._num_requests += 1
        request = GenerateRequest(request_id, tuple(prompt_token_ids), sampling)
        return await self._client.generate(request)


# --- the rollout -----------------------------------------------------------------------------


@dataclass
class Rollout:
    prompt_token_ids: list[int]
    # Everything after the prompt: generated tokens and observation tokens, in order.
    response_token_ids: list[int]
    # 1 per generated token, 0 per observation token.
    response_mask: bytearray
    # Per response token; 0.0 for observation tokens.
    rollout_logprobs: list[float]
    # Contiguous, in order, covering the whole response.
    spans: list[common_pb2.GenerationSpan]
    finish_reason: str  # "stop", "length", "max_turns", or the engine's ("abort", ...)
    num_turns: int
    # The response decoded once, special tokens skipped (rule rewards read it).
    response_text: str
    # One entry per tool call the policy made: turn, name, arguments, status, duration_s.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    generate_s: float = 0.0
    tool_s: float = 0.0

    def __post_init__(self) -> None:
        num_tokens = len(self.response_token_ids)
        assert len(self.response_mask) == len(self.rollout_logprobs) == num_tokens
        position = 0
        for span in self.spans:
            assert span.start == position < span.end, (position, span)
            mask = self.response_mask[span.start : span.end]
            assert set(mask) == {1 if span.generated else 0}, span
            position = span.end
        assert position == num_tokens, (position, num_tokens)


class ResponseBuilder:
    """Accumulates a response turn by turn with its mask, log-probs and spans."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.mask = bytearray()
        self.logprobs: list[float] = []
        self.spans: list[common_pb2.GenerationSpan] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_generation(self, generation: Generation, turn: int, replica: str) -> None:
        """Append the engine's tokens verbatim (mask 1), one span per weight version; tokens
        no version span covers get a span of version -1."""
        offset, num_tokens = len(self.token_ids), len(generation.token_ids)
        position = 0
        for version_span in sorted(generation.version_spans, key=lambda s: s.start):
            start, end = max(version_span.start, position), min(version_span.end, num_tokens)
            if start >= end:
                continue
            if start > position:
                self._span(offset + position, offset + start, UNKNOWN_VERSION, turn, replica)
            version = policy_version(version_span.version)
            self._span(offset + start, offset + end, version, turn, replica)
            position = end
        if position < num_tokens:
            self._span(offset + position, offset + num_tokens, UNKNOWN_VERSION, turn, replica)
        self.token_ids.extend(generation.token_ids)
        self.mask.extend(b"\x01" * num_tokens)
        self.logprobs.extend(generation.logprobs)

    def add_observation(self, token_ids: Sequence[int], turn: int) -> None:
        """Append tokens the policy did not sample (mask 0, log-prob 0.0)."""
        if not token_ids:
            return
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        self.mask.extend(bytes(len(token_ids)))
        self.logprobs.extend([0.0] * len(token_ids))
        self.spans.append(
            common_pb2.GenerationSpan(
                start=start,
                end=len(self.token_ids),
                policy_version=UNKNOWN_VERSION,
                turn=turn,
                generated=False,
            )
        )

    def _span(self, start: int, end: int, version: int, turn: int, replica: str) -> None:
        self.spans.append(
            common_pb2.GenerationSpan(
                start=start,
                end=end,
                policy_version=version,
                turn=turn,
                replica=replica,
                generated=True,
            )
        )

    def build(
        self,
        prompt: Sequence[int],
        tokenizer: PreTrainedTokenizerBase,
        finish_reason: str,
        num_turns: int,
        **extra: Any,
    ) -> Rollout:
        return Rollout(
            prompt_token_ids=list(prompt),
            response_token_ids=list(self.token_ids),
            response_mask=bytearray(self.mask),
            rollout_logprobs=list(self.logprobs),
            spans=list(self.spans),
            finish_reason=finish_reason,
            num_turns=num_turns,
            response_text=tokenizer.decode(self.token_ids, skip_special_tokens=True),
            **extra,
        )


def policy_version(version: str) -> int:
    """The engine's weight-version label as the trainer's integer version; -1 when the label
    is not an integer (an engine nobody has versioned yet says "default")."""
    try:
        return int(version)
    except ValueError:
        return UNKNOWN_VERSION


# --- context and contract --------------------------------------------------------------------


@dataclass(frozen=True)
class AgentContext:
    tokenizer: PreTrainedTokenizerBase
    # Base sampling (from the group's SamplingParams); max_tokens caps each generation.
    sampling: SamplingOptions
    # Most generations (assistant turns) in one rollout; 1: no tool round trip.
    max_turns: int
    # Budget over all turns, generated and observation tokens together.
    max_response_tokens: int
    tools: ToolTable
    # Calls past this many in one turn are answered with an error, not run.
    max_tool_calls_per_turn: int = 8

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_response_tokens < 1:
            raise ValueError(
                f"max_turns and max_response_tokens must be >= 1, got {self.max_turns}, "
                f"{self.max_response_tokens}"
            )
        if self.max_tool_calls_per_turn < 1:
            raise ValueError("max_tool_calls_per_turn must be >= 1")


class AgentLoop(abc.ABC):
    """Rolls out one trajectory. Engine errors propagate unchanged; a crashing or hanging
    tool raises ToolFailure; anything the policy gets wrong stays inside the rollout."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def run(
        self, group: common_pb2.PromptGroup, session: EngineSession, context: AgentContext
    ) -> Rollout: ...


# --- tool calls ------------------------------------------------------------------------------


async def _gather_all_or_cancel(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    # gather alone would leave the other tools running when one fails.
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# --- the loops -------------------------------------------------------------------------------


def _turn_sampling(context: AgentContext, max_tokens: int) -> SamplingOptions:
    base = context.sampling
    stops = base.stop_token_ids + tuple(
        t for t in rendering.turn_end_token_ids(context.tokenizer) if t not in base.stop_token_ids
    )
    return dataclasses.replace(base, max_tokens=max_tokens, stop_token_ids=stops)


class SingleTurn(AgentLoop):
    """One generation, stopped at the end of the assistant turn."""

    name = "single_turn"

    async def run(
        self, group: common_pb2.PromptGroup, session: EngineSession, context: AgentContext
    ) -> Rollout:
        prompt = rendering.prompt_token_ids(group, context.tokenizer, tools=None)
        max_tokens = min(context.sampling.max_tokens, context.max_response_tokens)
        started = time.monotonic()
        generation = await session.generate(prompt, _turn_sampling(context, max_tokens))
        response = ResponseBuilder()
        response.add_generation(generation, 0, session.replica_id)
        return response.build(
            prompt,
            context.tokenizer,
            generation.finish_reason,
            num_turns=1,
            generate_s=time.monotonic() - started,
        )


class ToolAgent(AgentLoop):
    """generating -> calling tools -> generating ... -> done.

    Done when a generation calls no tool ("stop"), does not end by a stop token (the engine's
    reason: "length", "abort"), still calls tools in the last allowed turn ("max_turns", the
    calls are not run), or when the tool answers would leave no room in the response budget
    for another generation ("length", the answers are not appended)."""

    name = "tool_agent"

    async def run(
        self, group: common_pb2.PromptGroup, session: EngineSession, context: AgentContext
    ) -> Rollout:
        tokenizer = context.tokenizer
        prompt = rendering.prompt_token_ids(group, tokenizer, tools=context.tools)
        response = ResponseBuilder()
        records: list[dict[str, Any]] = []
        timings = {"generate_s": 0.0, "tool_s": 0.0}
        finish_reason, num_turns = "length", 0
        for turn in range(context.max_turns):
            remaining = context.max_response_tokens - len(response)
            if remaining < 1:  # only when an engine returned more tokens than asked for
                break
            started = time.monotonic()
            generation = await session.generate(
                prompt + response.token_ids,
                _turn_sampling(context, min(context.sampling.max_tokens, remaining)),
            )
            timings["generate_s"] += time.monotonic() - started
            response.add_generation(generation, turn, session.replica_id)
            num_turns = turn + 1
            if generation.finish_reason != "stop":
                finish_reason = generation.finish_reason or "unknown"
                break
            text = tokenizer.decode(list(generation.token_ids), skip_special_tokens=False)
            calls = tool_syntax.parse_tool_calls(text)
            if not calls:
                finish_reason = "stop"
                break
            if num_turns == context.max_turns:
                records += [_record(turn, call, "not_run", 0.0) for call in calls]
                finish_reason = "max_turns"
                break
            started = time.monotonic()
            outputs = await self._call_tools(calls, turn, group, context, records)
            timings["tool_s"] += time.monotonic() - started
            last_id = generation.token_ids[-1] if generation.token_ids else None
            observation = rendering.observation_token_ids(
                tokenizer, outputs, last_id, context.tools
            )
            if len(response) + len(observation) >= context.max_response_tokens:
                finish_reason = "length"
                break
            response.add_observation(observation, turn)
        return response.build(
            prompt, tokenizer, finish_reason, num_turns, tool_calls=records, **timings
        )

    async def _call_tools(
        self,
        calls: Sequence[tool_syntax.ParsedToolCall],
        turn: int,
        group: common_pb2.PromptGroup,
        context: AgentContext,
        records: list[dict[str, Any]],
    ) -> list[str]:
        """Each call's answer, in order; the well-formed ones run concurrently."""
        limit = context.max_tool_calls_per_turn
        runnable = [
            (index, call)
            for index, call in enumerate(calls)
            if call.error is None and index < limit
        ]
        results = await _gather_all_or_cancel(
            [context.tools.invoke(call.name or "", call.arguments, group) for _, call in runnable]
        )
        by_index = dict(zip((index for index, _ in runnable), results, strict=True))
        outputs = []
        for index, call in enumerate(calls):
            if call.error is not None:
                outputs.append(error_message(call.error))
                records.append(_record(turn, call, "malformed", 0.0))
            elif index >= limit:
                outputs.append(error_message(f"too many tool calls in one turn (at most {limit})"))
                records.append(_record(turn, call, "not_run", 0.0))
            else:
                result = by_index[index]
                outputs.append(result.output)
                records.append(_record(turn, call, result.status, result.duration_s))
        return outputs


def _record(
    turn: int, call: tool_syntax.ParsedToolCall, status: str, duration_s: float
) -> dict[str, Any]:
    record = {
        "turn": turn,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
        "duration_s": duration_s,
    }
    if call.error is not None:
        record["error"] = call.error
    return record


BUILTIN_LOOPS: Mapping[str, type[AgentLoop]] = {
    SingleTurn.name: SingleTurn,
    ToolAgent.name: ToolAgent,
}


def build_agent_loops(user_loops: Mapping[str, str] | None = None) -> dict[str, AgentLoop]:
    """The built-in loops plus the operator's (`name -> package.module:AgentLoopClass`,
    constructed without arguments); ValueError naming a path that does not import or is not
    an AgentLoop, or a name that clashes with a built-in."""
    loops: dict[str, AgentLoop] = {name: cls() for name, cls in BUILTIN_LOOPS.items()}
    for name, path in (user_loops or {}).items():
        if name in loops:
            raise ValueError(f"user agent loop {name!r} ({path}) clashes with the built-in loop")
        loops[name] = import_object(path, "agent loop", subclass_of=AgentLoop)()
    return loops
