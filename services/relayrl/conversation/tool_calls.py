"""Tool-call syntax: how a policy calls a tool in its generated text,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen2 form the chat
template teaches), and how such calls are parsed back."""

from __future__ import annotations

import json
import re
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


_TOOL_CALL_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + "(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S
)


def _parse_block(body: str) -> ParsedToolCall:
    try:
        call = json.loads(body)
    except ValueError as exc:
        return ParsedToolCall(None, None, f"tool call is not valid JSON: {exc}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ParsedToolCall(None, None, "tool call needs a name and an arguments object")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return ParsedToolCall(call["name"], None, f"arguments are not valid JSON: {exc}")
    return ParsedToolCall(call["name"], arguments)


def parse_tool_calls(text: str) -> list[ParsedToolCall]:
    """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a generation,
    in order; malformed ones (bad JSON, no name, unclosed) carry the reason."""
    calls, end = [], 0
    for match in _TOOL_CALL_BLOCK.finditer(text):
        calls.append(_parse_block(match.group(1).strip()))
        end = match.end()
    if TOOL_CALL_OPEN in text[end:]:
        calls.append(ParsedToolCall(None, None, f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
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
