"""POST .../v1/responses: OpenAI's Responses API (what the OpenAI Agents SDK sends by default),
served as chat. A request's `instructions` and `input` items become the chat messages the chat
route takes, its function tools the chat tools; the turn is a chat turn of the same session
(the same template, the same prefix check, the same record), and the answer is a `response`
object whose output items are the reply's text and its function calls, streamed as the
Responses API's events when asked.

Input items: messages (`{"role", "content"}`, content a string or `input_text` / `output_text`
parts), `function_call` (the model's earlier call, as returned) and `function_call_output`
(the agent's tool result). A `message` item and the `function_call` items after it are one
assistant turn, as the gateway returned them. The server keeps no state between requests, so
`previous_response_id`, `conversation` and stored `prompt`s are refused: the agent sends the
whole input each time (the Agents SDK does unless told otherwise)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from relayrl.gateway.agent_http.domain import ChatRequest, TurnResult, TurnSampling
from relayrl.gateway.agent_http.errors import invalid
from relayrl.gateway.agent_http.protocol import checks
from relayrl.gateway.agent_http.protocol.base import (
    Answer,
    Flag,
    MaxTokens,
    ModelName,
    OpenAIRequest,
    RelayrlInfo,
    StructuredOutputs,
    Temperature,
    TokenTexts,
    TopP,
    checked,
    checked_if_absent,
    top_logprobs_of,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def check_instructions(value: Any, name: str) -> str | None:
    return checks.typed(str, "a string")(value, name)


def check_input(value: Any, name: str, instructions: str | None) -> list[dict[str, Any]]:
    """The input items (after the instructions, as a system message) as canonical chat
    messages."""
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise invalid("input: a string or a non-empty list of items is required", "input")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for position, item in enumerate(items):
        messages += _as_messages(item, f"input[{position}]", messages)
    return [checks.canonical_message(message, k) for k, message in enumerate(messages)]


def _as_messages(item: Any, where: str, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One input item as the chat messages it adds (a function call joins the assistant
    message before it)."""
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        return [{"role": item.get("role"), "content": _text(item.get("content"), where)}]
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        last = before[-1] if before else None
        if last is not None and last["role"] == "assistant":  # the turn's text, then its calls
            last.setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
            raise invalid(f"{where}: a function_call_output needs call_id and output", "input")
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, where)}]
    raise invalid(
        f"{where}: items of type {kind!r} are not served; send messages, function_call and "
        "function_call_output items",
        "input",
    )


def _text(content: Any, where: str) -> Any:
    """Content parts of the Responses API (`input_text`, `output_text`) as chat's text parts;
    anything else is left for the chat check to refuse."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.get("text")})
        else:
            parts.append(part)
    return parts


def check_tools(value: Any, name: str) -> list[dict[str, Any]] | None:
    """Function tools (`{"type": "function", "name", "description", "parameters"}`) as chat
    tools; built-in tools (web search, files, computer use) are not served."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("tools must be a list", "tools")
    chat_tools = []
    for position, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(
                f"tools[{position}]: only function tools are served, not {kind!r}", "tools"
            )
        function = {key: tool[key] for key in checks.FUNCTION_KEYS if key in tool}
        chat_tools.append({"type": "function", "function": function})
    return checks.check_tools(chat_tools, name)


def check_text(value: Any, name: str) -> dict[str, Any] | None:
    """`text.format` as chat's response_format: text, json_object or json_schema."""
    text = checks.typed(dict, "an object")(value, name)
    form = (text or {}).get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema" and isinstance(form.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"schema": form["schema"]}}
    raise invalid(
        "text.format: use {'type': 'text'}, {'type': 'json_object'} or "
        "{'type': 'json_schema', 'name': ..., 'schema': {...}}",
        "text",
    )


def check_stateless(value: Any, name: str) -> None:
    if value is not None:
        raise invalid(
            f"{name}: this server keeps no responses; send the whole conversation as input",
            name,
        )


Stateless = Annotated[Any, checked(check_stateless)]
TopLogprobs = Annotated[
    int | None, checked(checks.number(0, checks.MAX_TOP_LOGPROBS, integer=True))
]


class ResponsesRequest(OpenAIRequest):
    """The fields are checked in this order; the first wrong one is reported."""

    model: ModelName = checked_if_absent()
    previous_response_id: Stateless = None
    conversation: Stateless = None
    prompt: Stateless = None
    instructions: Annotated[str | None, checked(check_instructions)] = None
    input: Annotated[list[dict[str, Any]], checked(check_input, after="instructions")] = (
        checked_if_absent()
    )
    tools: Annotated[list[dict[str, Any]] | None, checked(check_tools)] = None
    tool_choice: Annotated[Any, checked(checks.check_tool_choice)] = None
    parallel_tool_calls: Flag = True
    max_output_tokens: MaxTokens = None
    temperature: Temperature = None
    top_p: TopP = None
    structured_outputs: StructuredOutputs = None  # vLLM's
    text: Annotated[dict[str, Any] | None, checked(check_text)] = None
    include: Annotated[list[str] | None, checked(checks.typed(list, "a list"))] = None
    top_logprobs: TopLogprobs = None
    stream: Flag = False

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def to_domain(self) -> ChatRequest:
        structured = checks.structured_outputs(self.structured_outputs, self.text)
        forced = checks.forced_tool_call(self.tool_choice, self.tools, structured)
        return ChatRequest(
            messages=self.input,
            tools=self.tools,
            sampling=TurnSampling(
                max_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_logprobs=(self.top_logprobs or 0) if self.wants_logprobs else 0,
                structured_outputs=forced or structured,
            ),
            parse_tool_calls=self.tool_choice != "none",
        )


# --- answers -----------------------------------------------------------------------------------


class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(Answer):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class MessageItem(Answer):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText]


class FunctionCallItem(Answer):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class InputTokensDetails(Answer):
    cached_tokens: int = 0


class OutputTokensDetails(Answer):
    reasoning_tokens: int = 0


class ResponseUsage(Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(Answer):
    reason: str


class ResponseObject(Answer):
    omit_if_none = frozenset({"relayrl"})

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[MessageItem | FunctionCallItem]
    usage: ResponseUsage | None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    relayrl: RelayrlInfo | None = None

    @classmethod
    def of(
        cls,
        result: TurnResult,
        model: str,
        request: ResponsesRequest,
        token_texts: TokenTexts,
    ) -> ResponseObject:
        name = f"{result.session_id}_{result.turn}"
        output: list[MessageItem | FunctionCallItem] = []
        if result.content or not result.tool_calls:
            text = OutputText(text=result.content or "")
            if request.wants_logprobs:
                text.logprobs = _logprobs(result, token_texts, request.top_logprobs or 0)
            output.append(MessageItem(id=f"msg_{name}", content=[text]))
        for k, call in enumerate(result.tool_calls):
            function = call["function"]
            output.append(
                FunctionCallItem(
                    id=f"fc_{name}_{k}",
                    call_id=call["id"],
                    name=function["name"],
                    arguments=function["arguments"],
                )
            )
        prompt, generated = len(result.prompt_token_ids), len(result.token_ids)
        incomplete = result.finish_reason == "length"
        details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        return cls(
            id=f"resp_{name}",
            created_at=result.created,
            status="incomplete" if incomplete else "completed",
            model=model,
            output=output,
            usage=ResponseUsage(
                input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated
            ),
            incomplete_details=details,
            instructions=request.instructions,
            tools=[{"type": "function", **tool["function"]} for tool in request.tools or ()],
            tool_choice=_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls,
            temperature=request.temperature,
            top_p=request.top_p,
            relayrl=RelayrlInfo.of(result),
        )

    def events(self) -> Iterator[dict[str, Any]]:
        """The finished answer as the Responses API's stream of events: created, then each
        output item added, its text or arguments, done; then completed."""
        number = iter(range(1 << 30))

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, "sequence_number": next(number), **fields}

        started = self.model_copy(update={"status": "in_progress", "output": [], "usage": None})
        yield event("response.created", response=started.model_dump())
        yield event("response.in_progress", response=started.model_dump())
        for index, item in enumerate(self.output):
            done = item.model_dump()
            yield event(
                "response.output_item.added",
                output_index=index,
                item=done
                | {"status": "in_progress"}
                | ({"content": []} if isinstance(item, MessageItem) else {"arguments": ""}),
            )
            where = {"item_id": item.id, "output_index": index}
            if isinstance(item, MessageItem):
                (part,) = item.content
                empty = part.model_copy(update={"text": "", "logprobs": []}).model_dump()
                yield event("response.content_part.added", **where, content_index=0, part=empty)
                logprobs = [entry.model_dump() for entry in part.logprobs]
                yield event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=part.text,
                    logprobs=logprobs,
                )
                yield event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=logprobs,
                )
                yield event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump()
                )
            else:
                yield event("response.function_call_arguments.delta", **where, delta=item.arguments)
                yield event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=item.arguments,
                )
            yield event("response.output_item.done", output_index=index, item=done)
        final = "response.incomplete" if self.status == "incomplete" else "response.completed"
        yield event(final, response=self.model_dump())


def _tool_choice(choice: Any) -> Any:
    """The request's tool_choice as the Responses API echoes it."""
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["name"]}
    return choice or "auto"


def _logprobs(result: TurnResult, token_texts: TokenTexts, top: int) -> list[TokenLogprob]:
    texts = token_texts(result.token_ids)
    alternatives = top_logprobs_of(result, token_texts, top)
    return [
        TokenLogprob(
            token=text,
            logprob=logprob,
            bytes=list(text.encode()),
            top_logprobs=[
                TopLogprob(token=alt, logprob=alt_logprob, bytes=list(alt.encode()))
                for alt, alt_logprob in position
            ],
        )
        for text, logprob, position in zip(texts, result.logprobs, alternatives, strict=True)
    ]


def event_lines(events: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Server-sent events as the Responses API sends them: each with its `event:` name."""
    for payload in events:
        yield f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()
