"""How a turn extends a session, one strategy per request kind (chat completions, completions on
text, completions on token ids), chosen from `CONVERSATIONS` by the request's kind.

A strategy plans the turn before anything is generated (the engine prompt: the first request's
prompt, or the tokens recorded so far plus the new messages' or text's tokens as observation;
the sampling) and, once the turn is recorded, shapes the answer and remembers what the agent was
shown, which its next request must extend. A request that does not extend it fails its plan
with 409 `conversation_diverged`; the sessions then try the session's other segments and, if it
extends none, start a new one (`AgentSessions._plan`)."""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from relayrl.conversation.rendering import turn_end_token_ids
from relayrl.conversation.tool_calls import TOOL_CALL_OPEN, parse_tool_calls
from relayrl.gateway.agent_http.domain import (
    ChatRequest,
    CompletionRequest,
    RequestKind,
    SessionKind,
    TurnResult,
    TurnSampling,
    fingerprint,
)
from relayrl.gateway.agent_http.errors import DIVERGED, AgentError, ErrorKind, diverged, invalid
from relayrl.gateway.agent_http.session import AgentSession
from relayrl.gateway.agent_http.template import (
    appended_token_ids,
    encode,
    message_key,
    render_chat,
)
from relayrl.gateway.config import AgentHttpConfig
from relayrl.inference.client import SamplingOptions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Request = TypeVar("Request", ChatRequest, CompletionRequest)


@dataclass(frozen=True)
class TurnPlan(Generic[Request]):
    """A turn ready to generate: computed before generating, recorded only if that works."""

    request: Request
    engine_prompt: list[int]
    observation: list[int]  # tokens appended before the generation (turn > 0)
    sampling: SamplingOptions


class SamplingRules:
    """A request's sampling within the gateway's limits, the session's response budget and,
    for a claimed group, the group's own sampling parameters."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: AgentHttpConfig) -> None:
        self._tokenizer = tokenizer
        self._config = config

    def check(self, sampling: TurnSampling) -> None:
        """What is wrong with the request itself comes before how it fits the session."""
        limit = self._config.max_tokens
        if sampling.max_tokens is not None and sampling.max_tokens > limit:
            raise invalid(
                f"max_tokens {sampling.max_tokens} is over the gateway's limit of {limit} "
                "(agent_http.max_tokens)",
                "max_tokens",
            )

    def options(
        self,
        session: AgentSession,
        requested: TurnSampling,
        num_observation_tokens: int,
        stop_ids: tuple[int, ...] = (),
    ) -> SamplingOptions:
        budget = self._config.max_response_tokens
        left = budget - session.num_response_tokens - num_observation_tokens
        if left < 1:
            raise AgentError(
                ErrorKind.INVALID,
                f"the session's budget of {budget} response tokens "
                "(agent_http.max_response_tokens) is used up; close the session",
                param="max_tokens",
                code="context_length_exceeded",
            )
        # A claimed group's SamplingParams fill what the request leaves out; otherwise
        # OpenAI's defaults (temperature 1, top_p 1, no top-k).
        claimed = session.claim.group is not None and session.spec.claim_id
        group = session.claim.group.sampling if claimed else None
        temperature = requested.temperature
        if temperature is None:
            temperature = group.temperature if group is not None else 1.0
        top_k = requested.top_k
        if top_k is None:
            top_k = group.top_k if group is not None and group.top_k > 0 else -1
        try:
            return SamplingOptions(
                max_tokens=min(requested.max_tokens or self._config.default_max_tokens, left),
                temperature=temperature,
                top_p=requested.top_p or (group.top_p if group is not None else 0) or 1.0,
                top_k=top_k,
                seed=requested.seed,
                stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                stop=tuple(dict.fromkeys(requested.stop)),
                top_logprobs=requested.top_logprobs,
                structured_outputs=requested.structured_outputs,
            )
        except ValueError as exc:
            raise AgentError(ErrorKind.INVALID, str(exc)) from None


class Conversation(abc.ABC, Generic[Request]):
    """One request kind's way to extend a session."""

    # The session kind it belongs to: a session takes requests of one kind only.
    session_kind: ClassVar[SessionKind]

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rules: SamplingRules) -> None:
        self.tokenizer = tokenizer
        self.rules = rules

    @abc.abstractmethod
    def plan(self, session: AgentSession, request: Request) -> TurnPlan[Request]:
        """The turn's engine prompt and sampling; AgentError when the request does not fit."""

    @abc.abstractmethod
    def answer(
        self, session: AgentSession, plan: TurnPlan[Request], result: TurnResult
    ) -> TurnResult:
        """Once the turn is recorded: the answer as the agent gets it, remembered as what the
        next request must extend."""


class ChatConversation(Conversation[ChatRequest]):
    """Chat completions: turn 0 renders the messages (and tools) with the chat template; a
    later request repeats the conversation so far (the replies as returned) and appends
    messages, whose tokens the template renders after an assistant turn."""

    session_kind = "chat"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rules: SamplingRules) -> None:
        super().__init__(tokenizer, rules)
        self._turn_end_ids = turn_end_token_ids(tokenizer)

    def plan(self, session: AgentSession, request: ChatRequest) -> TurnPlan[ChatRequest]:
        self.rules.check(request.sampling)
        tools = request.tools or None
        transcript = session.transcript
        if transcript.num_turns == 0:
            prompt_text = render_chat(self.tokenizer, request.messages, tools, True)
            prompt, observation = encode(self.tokenizer, prompt_text), []
        else:
            if fingerprint(tools) != fingerprint(session.dialogue.tools):
                raise diverged("the tools differ from the first request's")
            new = _new_messages(session.dialogue.messages, request.messages)
            observation = appended_token_ids(
                self.tokenizer, new, transcript.last_generated_id, tools
            )
            prompt = transcript.token_ids() + observation
        sampling = self.rules.options(
            session, request.sampling, len(observation), self._turn_end_ids
        )
        return TurnPlan(request, prompt, observation, sampling)

    def answer(
        self, session: AgentSession, plan: TurnPlan[ChatRequest], result: TurnResult
    ) -> TurnResult:
        request = plan.request
        tools = request.tools or None
        if session.transcript.num_turns == 1:  # the segment's first turn fixes its tools
            session.dialogue.tools = tools
        content: str | None = result.text
        tool_calls: list[dict[str, Any]] = []
        if request.parse_tool_calls and tools:
            tool_calls = _tool_calls(result.text, f"call-{session.session_id[:12]}-{result.turn}")
            if tool_calls:
                content = result.text[: result.text.index(TOOL_CALL_OPEN)].strip() or None
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        session.dialogue.messages = [*request.messages, reply]
        finish = result.finish_reason
        if tool_calls and finish == "stop":
            finish = "tool_calls"
        return dataclasses.replace(
            result, content=content, tool_calls=tuple(tool_calls), finish_reason=finish
        )


def _new_messages(
    history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages a request appends to the conversation so far."""
    if len(messages) < len(history):
        raise diverged(
            f"the request has {len(messages)} messages, fewer than the {len(history)} of "
            "the conversation so far"
        )
    for position, recorded in enumerate(history):
        if message_key(messages[position]) != message_key(recorded):
            what = (
                "the assistant reply the gateway returned"
                if recorded["role"] == "assistant"
                else f"the recorded {recorded['role']} message"
            )
            raise diverged(f"messages[{position}] is not {what}")
    new = messages[len(history) :]
    if not new:
        raise AgentError(
            ErrorKind.CONFLICT,
            "the request adds no message after the assistant's last reply; append the "
            "tool results or the next user turn",
            code=DIVERGED,
        )
    return new


def _tool_calls(text: str, id_prefix: str) -> list[dict[str, Any]]:
    """The well-formed <tool_call> blocks of `text` as OpenAI tool calls."""
    calls = [call for call in parse_tool_calls(text) if call.error is None]
    return [
        {
            "id": f"{id_prefix}-{number}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for number, call in enumerate(calls)
    ]


class TextCompletion(Conversation[CompletionRequest]):
    """Completions on text: a later prompt starts with the previous prompt and the text
    returned for it; what follows is encoded as observation."""

    session_kind = "completion"

    def plan(
        self, session: AgentSession, request: CompletionRequest
    ) -> TurnPlan[CompletionRequest]:
        self.rules.check(request.sampling)
        text = request.prompt_text or ""
        if session.transcript.num_turns:
            shown = session.dialogue.text
            if shown is None or not text.startswith(shown):
                raise diverged(
                    "the prompt does not start with the previous prompt and the text "
                    "returned for it"
                )
            added = text[len(shown) :]
            # The text held back from the last answer (the stop string that ended it) is
            # among the recorded tokens already: an agent that writes it back (a ReAct
            # agent's "\nObservation:") does not add it twice.
            held_back = session.dialogue.held_back
            if held_back and added.startswith(held_back):
                added = added[len(held_back) :]
            new_ids = encode(self.tokenizer, added)
            prompt = session.transcript.token_ids() + new_ids
        else:
            new_ids, prompt = [], encode(self.tokenizer, text)
        return _completion_plan(self.rules, session, request, prompt, new_ids)

    def answer(
        self, session: AgentSession, plan: TurnPlan[CompletionRequest], result: TurnResult
    ) -> TurnResult:
        # The text history is known while the agent sends text.
        session.dialogue.text = (plan.request.prompt_text or "") + result.text
        session.dialogue.held_back = result.held_back
        return result


class TokenCompletion(Conversation[CompletionRequest]):
    """Completions on token ids: a later prompt starts with the session's recorded ids."""

    session_kind = "completion"

    def plan(
        self, session: AgentSession, request: CompletionRequest
    ) -> TurnPlan[CompletionRequest]:
        self.rules.check(request.sampling)
        recorded = session.transcript.token_ids()
        ids = list(request.prompt_token_ids or ())
        num_turns = session.transcript.num_turns
        if num_turns and ids[: len(recorded)] != recorded:
            raise diverged("prompt token ids do not start with the session's tokens")
        new_ids = ids[len(recorded) :] if num_turns else []
        return _completion_plan(self.rules, session, request, ids, new_ids)

    def answer(
        self, session: AgentSession, plan: TurnPlan[CompletionRequest], result: TurnResult
    ) -> TurnResult:
        session.dialogue.text = None  # the text history is lost once the agent sends ids
        return result


def _completion_plan(
    rules: SamplingRules,
    session: AgentSession,
    request: CompletionRequest,
    prompt: list[int],
    new_ids: list[int],
) -> TurnPlan[CompletionRequest]:
    if not prompt:
        raise invalid("the prompt is empty", "prompt")
    sampling = rules.options(session, request.sampling, len(new_ids))
    return TurnPlan(request, prompt, new_ids, sampling)


# The strategy per request kind.
CONVERSATIONS: Mapping[RequestKind, type[Conversation[Any]]] = {
    "chat": ChatConversation,
    "text_completion": TextCompletion,
    "token_completion": TokenCompletion,
}


def build_conversations(
    tokenizer: PreTrainedTokenizerBase, config: AgentHttpConfig
) -> dict[RequestKind, Conversation[Any]]:
    rules = SamplingRules(tokenizer, config)
    return {kind: strategy(tokenizer, rules) for kind, strategy in CONVERSATIONS.items()}
