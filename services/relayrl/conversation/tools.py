"""Tools an agent loop offers the policy: the `Tool` contract, the built-ins (`calculator`,
`lookup`) and the `ToolTable` that maps the names a policy calls to tool instances.

Two kinds of failure, told apart on purpose (docs/architecture.md#agent-loops and
#failures-are-statuses):
- the policy's mistake (an unknown tool, arguments that do not fit the schema, an expression
  the calculator refuses) is answered with an error message the policy reads in its next
  turn: the rollout goes on and is rewarded as usual;
- the tool's own failure (it raises, returns something other than text, or runs past its
  timeout) is `ToolFailure`: an infrastructure fault, the trajectory is marked is_infra.

Tool output follows the shape the tiny model's tokenizer was trained on:
`{"result": ...}` or `{"error": "..."}` as JSON.
"""

from __future__ import annotations

import abc
import ast
import asyncio
import json
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from relayrl.core.dotted import import_object
from relayrl.proto.common.v1 import common_pb2

ToolStatus = Literal["ok", "unknown_tool", "bad_arguments"]


class ToolFailure(Exception):
    """A tool crashed or timed out: an infrastructure failure, never the policy's."""


class Tool(abc.ABC):
    """One callable tool. Subclasses set the class attributes the chat template shows the
    policy and implement `call`; they are constructed without arguments.

    `call` gets arguments already checked against `parameters` (required keys, property
    types); it returns text for the policy, including for inputs it refuses (say why, do not
    raise). Raising means the tool itself is broken (ToolFailure for the caller)."""

    name: ClassVar[str]
    description: ClassVar[str]
    # JSON schema of the arguments object (type "object" with "properties").
    parameters: ClassVar[dict[str, Any]]

    @abc.abstractmethod
    async def call(self, arguments: Mapping[str, Any], group: common_pb2.PromptGroup) -> str: ...

    def schema(self) -> dict[str, Any]:
        """The OpenAI function form chat templates expect in `tools=`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def result_message(value: Any) -> str:
    return json.dumps({"result": value}, ensure_ascii=False)


def error_message(text: str) -> str:
    return json.dumps({"error": text}, ensure_ascii=False)


# --- calculator ------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
# Integers beyond this many bits are refused before they are computed (2**4096 has 1234 digits).
MAX_INT_BITS = 4096

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """The expression is not one the calculator evaluates; the message is for the policy."""


def _bits(value: int | float) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_size(left: int | float, op: type[ast.operator], right: int | float) -> None:
    # Refuse before computing: 9**9**9 would otherwise hold the event loop for minutes.
    if op is ast.Pow and isinstance(left, int) and isinstance(right, int) and right > 0:
        # floor(log2|left|) * right bits at least.
        if (_bits(left) - 1) * right > MAX_INT_BITS:
            raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    elif op is ast.Mult and _bits(left) + _bits(right) > MAX_INT_BITS + 1:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):  # not bool, str, complex, None
            return node.value
        raise CalculatorError(f"unsupported constant {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(left, type(node.op), right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(value, complex):
            raise CalculatorError("result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result too large")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
        return value
    element = type(getattr(node, "op", node)).__name__
    raise CalculatorError(
        f"unsupported element {element}: use numbers, + - * / // % **, parentheses"
    )


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression over int and float literals; CalculatorError
    (with a message for the policy) for anything else: names, calls, attributes, strings,
    comparisons, results over MAX_INT_BITS or not finite."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not a valid arithmetic expression") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "For example (12 + 30) * 2."}
        },
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def call(self, arguments: Mapping[str, Any], group: common_pb2.PromptGroup) -> str:
        try:
            return result_message(evaluate_expression(arguments["expression"]))
        except CalculatorError as exc:
            return error_message(str(exc))


# --- lookup ----------------------------------------------------------------------------------

LOOKUP_LABEL_PREFIX = "lookup:"


class Lookup(Tool):
    """A value only the tool knows: the group's label `lookup:<key>`. A task hides facts
    there that the policy must fetch (the prompt names the key, never the value)."""

    name = "lookup"
    description = "Look up the value stored under a key."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"key": {"type": "string", "description": "The key to look up."}},
        "required": ["key"],
        "additionalProperties": False,
    }

    async def call(self, arguments: Mapping[str, Any], group: common_pb2.PromptGroup) -> str:
        key = arguments["key"]
        value = group.labels.get(LOOKUP_LABEL_PREFIX + key)
        if value is None:
            return error_message(f"no value for key {key!r}")
        return result_message(value)


BUILTIN_TOOLS: Mapping[str, type[Tool]] = {
    Calculator.name: Calculator,
    Lookup.name: Lookup,
}


# --- argument checks -------------------------------------------------------------------------

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, Mapping),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """Why `arguments` does not fit the tool's JSON schema, or None. Checks the subset tools
    here use: an object, required keys, no unknown keys when additionalProperties is false,
    the top-level properties' `type` and `enum`."""
    if not isinstance(arguments, Mapping):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties: Mapping[str, Any] = schema.get("properties", {})
    missing = [key for key in schema.get("required", ()) if key not in arguments]
    if missing:
        return f"missing argument(s): {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return f"unknown argument(s): {', '.join(map(str, unknown))}"
    for key, value in arguments.items():
        spec = properties.get(key, {})
        types = spec.get("type")
        if types is not None:
            allowed = [types] if isinstance(types, str) else list(types)
            if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in allowed):
                return f"argument {key!r} must be of type {' or '.join(allowed)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}"
    return None


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the policy reads
    status: ToolStatus
    duration_s: float


class ToolTable:
    """The tools a gateway offers: the built-ins plus the operator's, by dotted path.

    `user_tools` maps a name to `package.module:ToolClass`; the name must be the class's
    `name` (the one the policy calls) and not a built-in's. `enabled` limits the table to
    some names (None: all). Each call runs under `timeout_s`; output past `max_output_chars`
    is cut (the response budget would drop it anyway)."""

    def __init__(
        self,
        user_tools: Mapping[str, str] | None = None,
        *,
        enabled: Sequence[str] | None = None,
        timeout_s: float = 30.0,
        max_output_chars: int = 16_384,
    ) -> None:
        if timeout_s <= 0 or max_output_chars < 1:
            raise ValueError("timeout_s must be > 0 and max_output_chars >= 1")
        classes: dict[str, type[Tool]] = dict(BUILTIN_TOOLS)
        for name, path in (user_tools or {}).items():
            if name in BUILTIN_TOOLS:
                raise ValueError(f"user tool {name!r} ({path}) clashes with the built-in tool")
            cls = import_object(path, "tool", subclass_of=Tool)
            if getattr(cls, "name", None) != name:
                raise ValueError(
                    f"tool {path!r} is named {getattr(cls, 'name', None)!r}; configure it "
                    f"under that name, not {name!r}"
                )
            classes[name] = cls
        if enabled is not None:
            unknown = sorted(set(enabled) - set(classes))
            if unknown:
                raise ValueError(
                    f"unknown tool(s) {', '.join(unknown)} (known: {', '.join(sorted(classes))})"
                )
            classes = {name: classes[name] for name in enabled}
        self._tools: dict[str, Tool] = {name: cls() for name, cls in classes.items()}
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The tools in OpenAI function form, for the chat template's `tools=`."""
        return [tool.schema() for tool in self._tools.values()]

    async def call(
        self, name: str, arguments: Mapping[str, Any], group: common_pb2.PromptGroup
    ) -> str:
        """The tool's answer; a message (not an exception) for an unknown tool or arguments
        that do not fit its schema; ToolFailure when the tool crashes or times out."""
        return (await self.invoke(name, arguments, group)).output

    async def invoke(self, name: str, arguments: Any, group: common_pb2.PromptGroup) -> ToolResult:
        """`call`, with the outcome's status and duration."""
        started = time.monotonic()
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            message = error_message(f"unknown tool {name!r} (available: {known})")
            return ToolResult(message, "unknown_tool", 0.0)
        problem = check_arguments(tool.parameters, arguments)
        if problem is not None:
            return ToolResult(error_message(f"{name}: {problem}"), "bad_arguments", 0.0)
        try:
            async with asyncio.timeout(self.timeout_s):
                output = await tool.call(arguments, group)
        except TimeoutError:
            raise ToolFailure(f"tool {name} did not answer in {self.timeout_s} s") from None
        except Exception as exc:
            raise ToolFailure(f"tool {name} crashed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(output, str):
            raise ToolFailure(f"tool {name} returned {type(output).__name__}, not str")
        if len(output) > self.max_output_chars:
            output = output[: self.max_output_chars] + " ...[truncated]"
        return ToolResult(output, "ok", time.monotonic() - started)
