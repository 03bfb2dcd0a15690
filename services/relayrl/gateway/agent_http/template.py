"""The policy's chat template as an agent session uses it: the first turn's prompt, the tokens
between a generation and the next one when any messages follow it.
Failures are the agent's (`AgentError`, 400): the template refused what the agent sent."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relayrl.conversation import rendering
from relayrl.gateway.agent_http.errors import AgentError, ErrorKind, invalid

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    """The chat template's text; AgentError(INVALID) when the template refuses the input."""
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except (jinja2.TemplateError, TypeError) as exc:
        raise AgentError(
            ErrorKind.INVALID, f"the policy's chat template cannot render these messages: {exc}"
        ) from None
    assert isinstance(text, str)
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # Rendered text carries its own special tokens: no BOS/EOS around it.
    return list(tokenizer.encode(text, add_special_tokens=False))


def appended_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    last_generated_id: int | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[int]:
    """Tokens between an assistant turn and the next generation when `messages` (any roles)
    follow it (`relayrl.conversation.rendering.appended_token_ids`, with this endpoint's
    rendering and errors)."""
    token_ids = rendering.appended_token_ids(
        tokenizer,
        messages,
        last_generated_id,
        lambda rendered, add_generation_prompt: render_chat(
            tokenizer, rendered, tools, add_generation_prompt
        ),
    )
    if token_ids is None:
        raise invalid(
            "the chat template renders earlier turns differently once these messages follow; "
            "the gateway cannot append them to the sampled tokens"
        )
    return token_ids


def message_key(message: Mapping[str, Any]) -> str:
    """What must match for a message to count as the same turn (content up to surrounding
    whitespace, which agents trim; the policy saw the recorded tokens either way)."""
    key = dict(message)
    key["content"] = (key.get("content") or "").strip()
    return json.dumps(key, sort_keys=True)
