"""What every route's models share: parsing a request into its model with OpenAI's error for
the first wrong field, the field types of the sampling parameters, the answers' base class and
the parts every completion answer carries (usage, the `relayrl` object)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, NoReturn, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from relayrl.gateway.agent_http.domain import TurnResult, TurnSampling
from relayrl.gateway.agent_http.errors import AgentError, ErrorKind, invalid
from relayrl.gateway.agent_http.protocol import checks

# --- parsing ---------------------------------------------------------------------------------

Model = TypeVar("Model", bound=BaseModel)
_AGENT_ERROR = "agent_error"


def parse(model: type[Model], body: Mapping[str, Any], model_name: str = "") -> Model:
    """`body` as `model`; AgentError (OpenAI's error) for the first field that is wrong.
    `model_name`: the model this gateway serves, which requests must name."""
    try:
        return model.model_validate(body, context={"model_name": model_name})
    except ValidationError as exc:
        raise _agent_error(exc) from None


def _agent_error(exc: ValidationError) -> AgentError:
    first = exc.errors()[0]
    context = first.get("ctx") or {}
    if first["type"] == _AGENT_ERROR:
        kind = ErrorKind(context["kind"])
        return AgentError(kind, context["message"], param=context["param"], code=context["code"])
    # Not one of the checks (a field type they leave to pydantic): still a bad request.
    where = ".".join(str(part) for part in first["loc"])
    return invalid(f"{where}: {first['msg']}", str(first["loc"][0]) if first["loc"] else None)


def reject(error: AgentError) -> NoReturn:
    """Raise `error` as a validation error pydantic collects for the field being checked."""
    raise PydanticCustomError(
        _AGENT_ERROR,
        "{message}",
        {
            "kind": error.kind.value,
            "message": error.message,
            "param": error.param,
            "code": error.code,
        },
    )


def checked(
    check: Callable[..., Any], *, after: str | None = None, context: str | None = None
) -> BeforeValidator:
    """A field validator from `check(value, field_name)`. `after`: a field declared before
    this one whose value `check` takes too (None when absent or invalid: its own error comes
    first); `context`: a key of the validation context whose value `check` takes too."""

    def validate(value: Any, info: ValidationInfo) -> Any:
        args: tuple[Any, ...] = ()
        if after is not None:
            args = (info.data.get(after),)
        elif context is not None:
            args = ((info.context or {}).get(context),)
        try:
            return check(value, info.field_name or "", *args)
        except AgentError as exc:
            reject(exc)

    return BeforeValidator(validate)


def checked_if_absent() -> Any:
    """The default of a field whose check runs when it is absent too (it says it is missing)."""
    return Field(None, validate_default=True)


class OpenAIRequest(BaseModel):
    """A request body; fields the model does not declare are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


# --- field types: what a field holds once valid, and the check that says what is wrong -------

Flag = Annotated[bool, checked(checks.flag)]
Object = Annotated[dict[str, Any] | None, checked(checks.typed(dict, "an object"))]
Text = Annotated[str, checked(checks.typed(str, "a string", default=""))]
ModelName = Annotated[str, checked(checks.check_model, context="model_name")]
NotOne = Annotated[
    Any,
    checked(
        checks.unsupported_unless(
            (None, 1), "n: one choice per request (a session is one trajectory)"
        )
    ),
]
NoBestOf = Annotated[Any, checked(checks.unsupported_unless((None, 1), "{name} is not supported"))]
Penalty = Annotated[
    Any,
    checked(
        checks.unsupported_unless(
            (None, 0, 0.0), "{name} is not supported (it changes the policy's distribution)"
        )
    ),
]
LogitBias = Annotated[Any, checked(checks.check_logit_bias)]
MaxTokens = Annotated[int | None, checked(checks.MAX_TOKENS)]
LegacyMaxTokens = Annotated[
    int | None, checked(checks.optional_max_tokens, after="max_completion_tokens")
]
TopK = Annotated[int | None, checked(checks.number(-1, 10**9, integer=True))]
Temperature = Annotated[int | float | None, checked(checks.number(0.0, 2.0))]
TopP = Annotated[int | float | None, checked(checks.number(1e-9, 1.0))]
Seed = Annotated[int | None, checked(checks.number(-(2**63), 2**63 - 1, integer=True))]
Stop = Annotated[tuple[str, ...], checked(checks.check_stop)]
StructuredOutputs = Annotated[
    dict[str, Any] | None, checked(checks.typed(dict, "an object such as {'regex': ...}"))
]
# Checked together with structured_outputs (one of the two, its keys), even when absent.
ResponseFormat = Annotated[
    dict[str, Any] | None, checked(checks.check_response_format, after="structured_outputs")
]


class SamplingRequest(OpenAIRequest):
    """The sampling and answer fields the chat and the completions requests share, declared
    once. Each route checks them after its own leading fields (the model, the messages or the
    prompt) and before its log-prob fields: it is declared as `class Route(SamplingRequest,
    RouteLeading)`, since pydantic orders the fields of the last base first, then those of
    the bases before it, then the class's own."""

    n: NotOne = None
    best_of: NoBestOf = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    max_completion_tokens: MaxTokens = None
    max_tokens: LegacyMaxTokens = None
    top_k: TopK = None
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    stop: Stop = ()
    include_stop_str_in_output: Flag = False  # vLLM's
    structured_outputs: StructuredOutputs = None
    response_format: ResponseFormat = checked_if_absent()
    stream: Flag = False
    stream_options: Object = None

    if TYPE_CHECKING:  # each route declares it last, after its log-prob fields
        return_token_ids: bool

    @abstractmethod
    def logprob_alternatives(self) -> int | None:
        """None: no log-probs in the answer; else the alternatives per token besides the
        sampled one (0: the sampled token's log-prob only). Each route reads its own fields."""

    def options(self) -> AnswerOptions:
        return AnswerOptions.of(self)


def sampling_of(request: SamplingRequest) -> TurnSampling:
    max_tokens = request.max_completion_tokens
    return TurnSampling(
        max_tokens=request.max_tokens if max_tokens is None else max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=None if request.top_k in (None, 0) else request.top_k,
        seed=request.seed,
        stop=request.stop,
        include_stop_str_in_output=request.include_stop_str_in_output,
        top_logprobs=request.logprob_alternatives() or 0,
        structured_outputs=checks.structured_outputs(
            request.structured_outputs, request.response_format
        ),
    )


@dataclass(frozen=True)
class AnswerOptions:
    """How the answer is given: streamed, with usage, log-probs, token ids."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, from the engine
    return_token_ids: bool = False

    @classmethod
    def of(cls, request: SamplingRequest) -> AnswerOptions:
        stream_options = request.stream_options or {}
        alternatives = request.logprob_alternatives()
        return cls(
            stream=request.stream,
            include_usage=request.stream and bool(stream_options.get("include_usage")),
            logprobs=alternatives is not None,
            top_logprobs=alternatives or 0,
            return_token_ids=request.return_token_ids,
        )


# --- answers -----------------------------------------------------------------------------------


class Answer(BaseModel):
    """An answer body. Fields in `omit_if_none` are left out when None; others are always
    there (`null` included)."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_if_none}


class ErrorInfo(Answer):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Answer):
    """OpenAI's error shape, for every failure of every route."""

    error: ErrorInfo

    @classmethod
    def of(cls, error: AgentError) -> ErrorResponse:
        return cls.plain(error.message, error.kind.value, param=error.param, code=error.code)

    @classmethod
    def plain(
        cls, message: str, kind: str, *, param: str | None = None, code: str | None = None
    ) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=kind, param=param, code=code))


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, result: TurnResult) -> Usage:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return cls(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


class WeightVersionSpan(Answer):
    version: int
    start: int
    end: int


class RelayrlInfo(Answer):
    """Beyond OpenAI: the session, turn, replica and the weight versions that sampled it."""

    session_id: str
    turn: int
    replica: str
    weight_versions: list[WeightVersionSpan]

    @classmethod
    def of(cls, result: TurnResult) -> RelayrlInfo:
        return cls(
            session_id=result.session_id,
            turn=result.turn,
            replica=result.replica_id,
            weight_versions=[
                WeightVersionSpan(version=version, start=start, end=end)
                for version, start, end in result.version_spans
            ],
        )


# The text of each token id, one by one (the tokenizer's decode).
TokenTexts = Callable[[Sequence[int]], list[str]]


def top_logprobs_of(
    result: TurnResult, token_texts: TokenTexts, top: int
) -> list[list[tuple[str, float]]]:
    """Per generated token, its `top` most likely alternatives as (text, log-prob), most
    likely first (none when `top` is 0)."""
    if not top or not result.top_logprobs:
        return [[] for _ in result.token_ids]
    ranked = [position[:top] for position in result.top_logprobs]
    texts = iter(token_texts([token for position in ranked for token, _ in position]))
    return [[(next(texts), logprob) for _, logprob in position] for position in ranked]
