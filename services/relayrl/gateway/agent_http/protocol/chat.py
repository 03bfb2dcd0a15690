"""POST /sessions/{id}/v1/chat/completions: OpenAI's chat completions request (and vLLM's
top_k, structured_outputs, return_token_ids), its answer and its stream of chunks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from relayrl.gateway.agent_http.domain import ChatRequest, TurnResult
from relayrl.gateway.agent_http.protocol import checks
from relayrl.gateway.agent_http.protocol.base import (
    Answer,
    AnswerOptions,
    Flag,
    ModelName,
    OpenAIRequest,
    RelayrlInfo,
    SamplingRequest,
    TokenTexts,
    Usage,
    checked,
    checked_if_absent,
    sampling_of,
    top_logprobs_of,
)


class ChatLeading(OpenAIRequest):
    """The chat request's fields checked before the shared sampling fields."""

    model: ModelName = checked_if_absent()
    messages: Annotated[list[dict[str, Any]], checked(checks.check_messages)] = checked_if_absent()
    tool_choice: Annotated[Any, checked(checks.check_tool_choice)] = None
    tools: Annotated[list[dict[str, Any]] | None, checked(checks.check_tools)] = None


class ChatCompletionRequest(SamplingRequest, ChatLeading):
    """The fields are checked in this order (`ChatLeading`'s, `SamplingRequest`'s, these); the
    first wrong one is reported."""

    logprobs: Flag = False
    top_logprobs: Annotated[int, checked(checks.check_top_logprobs, after="logprobs")] = 0
    return_token_ids: Flag = False

    def logprob_alternatives(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def to_domain(self) -> ChatRequest:
        sampling = sampling_of(self)
        forced = checks.forced_tool_call(self.tool_choice, self.tools, sampling.structured_outputs)
        if forced is not None:
            sampling = dataclasses.replace(sampling, structured_outputs=forced)
        return ChatRequest(
            messages=self.messages,
            tools=self.tools,
            sampling=sampling,
            parse_tool_calls=self.tool_choice != "none",
        )


class FunctionCall(Answer):
    name: str
    arguments: str


class ToolCall(Answer):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Answer):
    omit_if_none = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatTopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(Answer):
    content: list[ChatTokenLogprob]

    @classmethod
    def of(cls, result: TurnResult, token_texts: TokenTexts, top: int) -> ChatLogprobs:
        texts = token_texts(result.token_ids)
        alternatives = top_logprobs_of(result, token_texts, top)
        return cls(
            content=[
                ChatTokenLogprob(
                    token=text,
                    logprob=logprob,
                    bytes=list(text.encode()),
                    top_logprobs=[
                        ChatTopLogprob(token=alt, logprob=alt_logprob, bytes=list(alt.encode()))
                        for alt, alt_logprob in position
                    ],
                )
                for text, logprob, position in zip(
                    texts, result.logprobs, alternatives, strict=True
                )
            ]
        )


class ChatChoice(Answer):
    omit_if_none = frozenset({"token_ids"})

    index: int = 0
    message: ChatMessage
    finish_reason: str
    logprobs: ChatLogprobs | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(Answer):
    omit_if_none = frozenset({"prompt_token_ids"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    relayrl: RelayrlInfo
    prompt_token_ids: list[int] | None = None

    @classmethod
    def of(
        cls, result: TurnResult, model: str, options: AnswerOptions, token_texts: TokenTexts
    ) -> ChatCompletionResponse:
        message = ChatMessage(
            content=result.content,
            tool_calls=[ToolCall.model_validate(call) for call in result.tool_calls] or None,
        )
        choice = ChatChoice(
            message=message,
            finish_reason=result.finish_reason,
            logprobs=(
                ChatLogprobs.of(result, token_texts, options.top_logprobs)
                if options.logprobs
                else None
            ),
            token_ids=list(result.token_ids) if options.return_token_ids else None,
        )
        return cls(
            id=f"chatcmpl-{result.session_id}-{result.turn}",
            created=result.created,
            model=model,
            choices=[choice],
            usage=Usage.of(result),
            relayrl=RelayrlInfo.of(result),
            prompt_token_ids=list(result.prompt_token_ids) if options.return_token_ids else None,
        )

    def chunks(self, options: AnswerOptions) -> Iterator[ChatCompletionChunk]:
        """The finished answer as `chat.completion.chunk`s: the message, then the finish."""
        (choice,) = self.choices
        message = choice.message
        tool_calls = [
            DeltaToolCall(index=k, id=call.id, function=call.function)
            for k, call in enumerate(message.tool_calls or ())
        ]
        delta = ChatDelta(
            role="assistant", content=message.content or "", tool_calls=tool_calls or None
        )
        head = {"id": self.id, "created": self.created, "model": self.model}
        first = ChatChunkChoice(delta=delta, finish_reason=None, logprobs=choice.logprobs)
        yield ChatCompletionChunk(**head, choices=[first], relayrl=self.relayrl)
        finish = ChatFinishChoice(delta=ChatDelta(), finish_reason=choice.finish_reason)
        yield ChatCompletionChunk(**head, choices=[finish])
        if options.include_usage:
            yield ChatCompletionChunk(**head, choices=[], usage=self.usage)


class DeltaToolCall(Answer):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(Answer):
    omit_if_none = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Answer):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatFinishChoice(Answer):
    index: int = 0
    delta: ChatDelta
    finish_reason: str


class ChatCompletionChunk(Answer):
    omit_if_none = frozenset({"relayrl", "usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice | ChatFinishChoice]
    relayrl: RelayrlInfo | None = None
    usage: Usage | None = None
