"""Tool-call syntax: how a policy calls a tool in its generated text,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen2 form the chat
template teaches), and how such calls are parsed back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str | None
    arguments: Any
    # Why the call is malformed (the policy reads it); None for a well-formed call.
    error: str | None = None


_DECODER = json.JSONDecoder()


def _call_of(call: Any) -> ParsedToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ParsedToolCall(None, None, "tool call needs a name and an arguments object")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return ParsedToolCall(call["name"], None, f"arguments are not valid JSON: {exc}")
    return ParsedToolCall(call["name"], arguments)


def _block_at(text: str, body: int) -> tuple[ParsedToolCall, int] | None:
    """The block whose body starts at index `body`: its call and the index past its close
    tag; None when no close tag follows. The body is read as JSON first, so a close tag
    inside one of its strings (a sampled argument may hold any text) does not end it."""
    begin = len(text) - len(text[body:].lstrip())
    try:
        value, after = _DECODER.raw_decode(text, begin)
    except ValueError:
        pass
    else:
        close = len(text) - len(text[after:].lstrip())
        if text.startswith(TOOL_CALL_CLOSE, close):
            return _call_of(value), close + len(TOOL_CALL_CLOSE)
    close = text.find(TOOL_CALL_CLOSE, body)  # not a JSON value before a close tag
    if close == -1:
        return None
    try:
        call = _call_of(json.loads(text[body:close]))
    except ValueError as exc:
        call = ParsedToolCall(None, None, f"tool call is not valid JSON: {exc}")
    return call, close + len(TOOL_CALL_CLOSE)


def parse_tool_calls(text: str) -> list[ParsedToolCall]:
    """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a generation,
    in order; malformed ones (bad JSON, no name, unclosed) carry the reason."""
    calls = []
    start = text.find(TOOL_CALL_OPEN)
    while start != -1:
        block = _block_at(text, start + len(TOOL_CALL_OPEN))
        if block is None:
            calls.append(ParsedToolCall(None, None, f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
            break
        call, end = block
        calls.append(call)
        start = text.find(TOOL_CALL_OPEN, end)
    return calls


# Any JSON value, in the EBNF of vLLM's grammar-structured outputs (xgrammar).
_JSON_RULES = r"""
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( string ": " value ( ", " string ": " value )* )? "}"
array ::= "[" ( value ( ", " value )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\/bfnrt] )* "\""
number ::= "-"? [0-9]+ ( "." [0-9]+ )?
"""


def forced_call_grammar(names: list[str]) -> str:
    """A grammar whose every sentence is one tool call of the policy's form to one of `names`,
    with a JSON object of arguments: what an agent's tool_choice "required" (or a named
    function) makes the engine generate. The arguments are not held to the tool's schema:
    the policy's own arguments are what is trained, and the agent checks them."""
    # EBNF string literals escape as JSON strings do.
    head = json.dumps(TOOL_CALL_OPEN + '\n{"name": ')
    middle = json.dumps(', "arguments": ')
    tail = json.dumps("}\n" + TOOL_CALL_CLOSE)
    name = " | ".join(json.dumps(json.dumps(n)) for n in names)
    return f"root ::= {head} name {middle} object {tail}\nname ::= {name}{_JSON_RULES}"
