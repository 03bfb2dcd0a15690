"""POST /sessions/{id}/v1/completions: OpenAI's (legacy) completions request on one prompt, a
string or token ids (and vLLM's top_k, structured_outputs, return_token_ids), its answer and
its stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from relayrl.gateway.agent_http.domain import CompletionRequest, TurnResult
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


class CompletionsLeading(OpenAIRequest):
    """The completions request's fields checked before the shared sampling fields."""

    model: ModelName = checked_if_absent()
    echo: Annotated[Any, checked(checks.check_echo)] = None
    suffix: Annotated[Any, checked(checks.check_echo)] = None
    prompt: Annotated[str | tuple[int, ...], checked(checks.check_prompt)] = checked_if_absent()


class CompletionsRequest(SamplingRequest, CompletionsLeading):
    """The fields are checked in this order (`CompletionsLeading`'s, `SamplingRequest`'s,
    these); the first wrong one is reported."""

    # The number of alternatives per token besides the sampled one (0: its log-prob only).
    logprobs: Annotated[int | None, checked(checks.check_completion_logprobs)] = None
    return_token_ids: Flag = False

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def to_domain(self) -> CompletionRequest:
        if isinstance(self.prompt, str):
            return CompletionRequest(self.prompt, None, sampling_of(self))
        return CompletionRequest(None, tuple(self.prompt), sampling_of(self))


class CompletionLogprobs(Answer):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]

    @classmethod
    def of(cls, result: TurnResult, token_texts: TokenTexts, top: int) -> CompletionLogprobs:
        texts = token_texts(result.token_ids)
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        alternatives = top_logprobs_of(result, token_texts, top) if top else None
        return cls(
            tokens=texts,
            token_logprobs=list(result.logprobs),
            top_logprobs=[dict(at) for at in alternatives] if alternatives is not None else None,
            text_offset=offsets,
        )


class CompletionChoice(Answer):
    omit_if_none = frozenset({"token_ids"})

    index: int = 0
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None
    token_ids: list[int] | None = None


class CompletionResponse(Answer):
    omit_if_none = frozenset({"prompt_token_ids"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None  # None in a streamed chunk: the usage comes last, if asked for
    relayrl: RelayrlInfo
    prompt_token_ids: list[int] | None = None

    @classmethod
    def of(
        cls, result: TurnResult, model: str, options: AnswerOptions, token_texts: TokenTexts
    ) -> CompletionResponse:
        choice = CompletionChoice(
            text=result.text,
            finish_reason=result.finish_reason,
            logprobs=(
                CompletionLogprobs.of(result, token_texts, options.top_logprobs)
                if options.logprobs
                else None
            ),
            token_ids=list(result.token_ids) if options.return_token_ids else None,
        )
        return cls(
            id=f"cmpl-{result.session_id}-{result.turn}",
            created=result.created,
            model=model,
            choices=[choice],
            usage=Usage.of(result),
            relayrl=RelayrlInfo.of(result),
            prompt_token_ids=list(result.prompt_token_ids) if options.return_token_ids else None,
        )

    def chunks(self, options: AnswerOptions) -> Iterator[Answer]:
        """Streamed: the whole answer as one event, then (if asked) the usage."""
        yield self.model_copy(update={"usage": None})
        if options.include_usage and self.usage is not None:
            yield CompletionUsageChunk(
                id=self.id, created=self.created, model=self.model, usage=self.usage
            )


class CompletionUsageChunk(Answer):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Any] = Field(default_factory=list)
    usage: Usage
