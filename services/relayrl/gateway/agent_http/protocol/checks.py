"""The checks behind the request models' fields: each takes a field's JSON value and its name
and returns the value the field holds, or raises AgentError saying what to change. JSON's null
is the same as an absent field."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from relayrl.conversation.tool_calls import forced_call_grammar
from relayrl.core import env_reward
from relayrl.gateway.agent_http.errors import AgentError, ErrorKind, invalid

Check = Callable[[Any, str], Any]

ROLES = ("system", "developer", "user", "assistant", "tool")
STRUCTURED_OUTPUT_KEYS = frozenset(
    {
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
    }
)


# --- plain values ------------------------------------------------------------------------------


def typed(kind: type | tuple[type, ...], what: str, default: Any = None) -> Check:
    """A value of `kind` (`what` in words), or `default` when absent."""
    kinds = kind if isinstance(kind, tuple) else (kind,)

    def check(value: Any, name: str) -> Any:
        if value is None:
            return default
        # bool is an int in Python, never in JSON's eyes.
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise invalid(f"{name} must be {what}, got {value!r}", name)
        return value

    return check


def flag(value: Any, name: str) -> bool:
    return bool(typed(bool, "true or false")(value, name))


def number(low: float, high: float, *, integer: bool = False) -> Check:
    """A number (an integer) in [low, high], or None when absent."""
    of_type = typed(int if integer else (int, float), "an integer" if integer else "a number")

    def check(value: Any, name: str) -> Any:
        value = of_type(value, name)
        if value is not None and not low <= value <= high:
            raise invalid(f"{name} must be in [{low:g}, {high:g}], got {value}", name)
        return value

    return check


def check_model(value: Any, name: str, model_name: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid("model: name the model (this gateway serves one)", "model")
    if value != model_name:
        raise AgentError(
            ErrorKind.NOT_FOUND,
            f"the model {value!r} does not exist; this gateway serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    return value


# --- what the gateway does not do ------------------------------------------------------------


def unsupported_unless(allowed: tuple[Any, ...], message: str) -> Check:
    """Refuse any value but `allowed` with `message` (`{name}`: the field's name)."""

    def check(value: Any, name: str) -> Any:
        if value not in allowed:
            raise invalid(message.format(name=name), name)
        return value

    return check


def check_logit_bias(value: Any, name: str) -> Any:
    if value:
        raise invalid("logit_bias is not supported; steer with structured_outputs", name)
    return value


def check_echo(value: Any, name: str) -> Any:
    if value:
        raise invalid("echo and suffix are not supported", name)
    return value


# --- sampling ----------------------------------------------------------------------------------


MAX_TOKENS = number(1, 10**9, integer=True)


def optional_max_tokens(value: Any, name: str, max_completion_tokens: int | None) -> int | None:
    """max_tokens counts only when max_completion_tokens (its newer name) is absent."""
    return MAX_TOKENS(value, name) if max_completion_tokens is None else None


def check_stop(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a string or a list of strings", name)
    return tuple(stops)


def structured_outputs(
    given: dict[str, Any] | None, response_format: dict[str, Any] | None
) -> dict[str, Any] | None:
    """vLLM's structured outputs from `structured_outputs` or OpenAI's `response_format`."""
    if response_format is not None and response_format.get("type") not in (None, "text"):
        if given is not None:
            raise invalid("set response_format or structured_outputs, not both", "response_format")
        kind = response_format.get("type")
        if kind == "json_object":
            return {"json_object": True}
        schema = (response_format.get("json_schema") or {}).get("schema")
        if kind != "json_schema" or not isinstance(schema, dict):
            raise invalid(
                "response_format: use {'type': 'json_schema', 'json_schema': {'schema': {...}}}, "
                "{'type': 'json_object'} or {'type': 'text'}",
                "response_format",
            )
        return {"json": schema}
    if given is None:
        return None
    unknown = sorted(set(given) - STRUCTURED_OUTPUT_KEYS)
    if unknown or not given:
        raise invalid(
            f"structured_outputs: unknown keys {unknown}; use one of "
            f"{', '.join(sorted(STRUCTURED_OUTPUT_KEYS))}",
            "structured_outputs",
        )
    return given


def check_response_format(
    value: Any, name: str, given: dict[str, Any] | None
) -> dict[str, Any] | None:
    """response_format, checked together with structured_outputs (`given`)."""
    response_format = typed(dict, "an object")(value, name)
    structured_outputs(given, response_format)
    return response_format


# The alternatives per token the gateway passes on from the engine (OpenAI's limits: 20 for
# chat's top_logprobs, 5 for completions' logprobs; vLLM serves up to its max_logprobs, 20).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def check_top_logprobs(value: Any, name: str, logprobs: bool | None) -> int:
    """Chat's top_logprobs: the alternatives per token, with logprobs true."""
    count = number(0, MAX_TOP_LOGPROBS, integer=True)(value, name)
    if count and not logprobs:
        raise invalid("top_logprobs needs logprobs: true", name)
    return count or 0


def check_completion_logprobs(value: Any, name: str) -> int | None:
    """Completions' logprobs: the alternatives per token besides the sampled one (0 for the
    sampled token's log-prob only), or None for no log-probs."""
    return number(0, MAX_COMPLETION_LOGPROBS, integer=True)(value, name)


# --- chat --------------------------------------------------------------------------------------


def check_messages(value: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise invalid("messages: a non-empty list of chat messages is required", "messages")
    return [canonical_message(message, k) for k, message in enumerate(value)]


def check_tool_choice(value: Any, name: str) -> Any:
    """None, "auto", "none", "required", or {"name": ...} for a named function (chat's
    `{"type": "function", "function": {"name"}}` or the Responses API's
    `{"type": "function", "name"}`)."""
    if value in (None, "auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function", value)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return {"name": function["name"]}
    raise invalid(
        "tool_choice: 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def forced_tool_call(
    tool_choice: Any, tools: list[dict[str, Any]] | None, structured: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The structured output that makes the policy call a tool for tool_choice "required" or
    a named function (a grammar of the policy's tool-call form); None for the others."""
    if tool_choice in (None, "auto", "none"):
        return None
    names = [tool["function"]["name"] for tool in tools or ()]
    if not names:
        raise invalid(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if isinstance(tool_choice, dict):
        if tool_choice["name"] not in names:
            raise invalid(
                f"tool_choice names {tool_choice['name']!r}, which is not among the tools {names}",
                "tool_choice",
            )
        names = [tool_choice["name"]]
    if structured is not None:
        raise invalid(
            "a forced tool call (tool_choice) cannot be combined with response_format or "
            "structured_outputs",
            "tool_choice",
        )
    return {"grammar": forced_call_grammar(names)}


# What of a function definition the chat template is given: the model sees these. `strict` (and
# any other key) is a request to the API server, not part of what the model reads; the gateway
# does not constrain tool-call arguments (the policy's own calls are what is trained).
FUNCTION_KEYS = ("name", "description", "parameters")


def check_tools(value: Any, name: str) -> list[dict[str, Any]] | None:
    """The tools as the chat template renders them: each function's name, description and
    parameters only, so that an SDK adding `strict` gets the prompt a plain client gets."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("tools must be a list", "tools")
    canonical = []
    for position, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise invalid(
                f"tools[{position}]: use {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"tools[{position}].function.name is missing", "tools")
        kept = {key: function[key] for key in FUNCTION_KEYS if key in function}
        canonical.append({"type": "function", "function": kept})
    return canonical or None


def canonical_message(message: Any, position: int) -> dict[str, Any]:
    """An OpenAI message as the gateway compares and renders it: text content, developer as
    system, tool-call arguments re-serialised; fields the template does not use dropped."""
    where = f"messages[{position}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        raise invalid(f"{where}.content is missing", "messages")
    canonical: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": "" if content is None else _text_content(content, where),
    }
    for name in ("name", "tool_call_id"):
        if isinstance(message.get(name), str):
            canonical[name] = message[name]
    if tool_calls:
        if not isinstance(tool_calls, list):
            raise invalid(f"{where}.tool_calls must be a list", "messages")
        canonical["tool_calls"] = [
            _canonical_tool_call(call, f"{where}.tool_calls[{k}]")
            for k, call in enumerate(tool_calls)
        ]
    return canonical


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{where}.content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content: a text part needs a string `text`", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{where}.content must be a string or a list of text parts", "messages")


def _canonical_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where}: a tool call needs function.name and arguments", "messages")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    # The same arguments however the agent serialised them; invalid JSON (the policy may have
    # produced it) is kept as sent.
    with contextlib.suppress(ValueError):
        arguments = json.dumps(json.loads(arguments))
    canonical = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        canonical["id"] = call["id"]
    return canonical


# --- completions and sessions ------------------------------------------------------------------


def check_prompt(value: Any, name: str) -> str | tuple[int, ...]:
    prompt = value
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    raise invalid(
        "prompt: one string or one list of token ids (batches: one session per trajectory)",
        "prompt",
    )


def check_labels(value: Any, name: str) -> dict[str, str]:
    labels = value or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise invalid("labels must map strings to strings", "labels")
    return labels


def check_env_reward(value: Any, name: str) -> env_reward.EnvReward | None:
    """`{"status": "ok" | "fail" | "error", "score": number, "message": string}`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"{name} must be an object {{status, score, message}}", name)
    unknown = sorted(set(value) - {"status", "score", "message"})
    if unknown:
        raise invalid(f"{name}: unknown fields {unknown}; known: message, score, status", name)
    status, score, message = value.get("status"), value.get("score", 0.0), value.get("message", "")
    if status not in env_reward.STATUSES:
        raise invalid(f"{name}.status must be one of {', '.join(env_reward.STATUSES)}", name)
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise invalid(f"{name}.score must be a number", name)
    if status != "error" and "score" not in value:
        raise invalid(f"{name}.score is required when status is {status!r}", name)
    if not isinstance(message, str):
        raise invalid(f"{name}.message must be a string", name)
    try:
        return env_reward.EnvReward(status, float(score), message)
    except ValueError as exc:
        raise invalid(f"{name}: {exc}", name) from None
