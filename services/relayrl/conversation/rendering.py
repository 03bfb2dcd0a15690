"""Prompt rendering: the token ids of a prompt group's prompt, of the end of an assistant turn
and of the observation that follows a tool call, all derived from the tokenizer's chat
template. The gateway's agent loops render rollouts with it, and `relayrl-trainer sft` and the
tasks render their examples with it, so that both see the same tokens.

How the trajectory relates to the chat template. The observation after turn k is the text
the template renders between an assistant message and the next generation prompt (for the
tiny model's ChatML: `\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>
\\n<|im_start|>assistant\\n`). It is derived from the template itself, not hard-coded: render
[user, assistant] and [user, assistant, tool...] + generation prompt and keep the suffix.
When the generation ended with the token that closes an assistant turn (`<|im_end|>`), that
token is already in the response and the observation starts after it. So prompt + response
is what `apply_chat_template(messages + [assistant(content=<generated text>), tool...],
add_generation_prompt=True)` renders, with these deviations, all kept on purpose:
- the generated tokens are the sampled ones, which need not be the canonical tokenisation
  of their text (re-tokenising the rendered text can give other ids);
- a template that re-renders tool calls from structured `tool_calls` (JSON re-serialised)
  can differ from the generated text in whitespace or key order;
- a generation that stopped on another stop token (say `<|endoftext|>`) keeps that token and
  the observation closes the turn with the template's own `<|im_end|>` after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relayrl.conversation.tools import ToolTable
from relayrl.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TURN_END_TOKEN = "<|im_end|>"


def chat_messages(group: common_pb2.PromptGroup) -> list[dict[str, str]]:
    """The group's messages as the chat template takes them."""
    messages = []
    for message in group.messages:
        entry = {"role": message.role, "content": message.content}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    tools: ToolTable | None,
    add_generation_prompt: bool,
) -> str:
    """The chat template over `messages`, with the tools' schemas when `tools` is given."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=(tools.schemas() or None) if tools is not None else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    assert isinstance(text, str)
    return text


def prompt_token_ids(
    group: common_pb2.PromptGroup, tokenizer: PreTrainedTokenizerBase, tools: ToolTable | None
) -> list[int]:
    """`group.prompt_token_ids` when set (used as given), else the chat template over
    `group.messages` (with the tools' schemas when `tools` is given) and the generation
    prompt."""
    if group.prompt_token_ids:
        return list(group.prompt_token_ids)
    if not group.messages:
        raise ValueError(f"group {group.uid}: no prompt: set prompt_token_ids or messages")
    text = render(tokenizer, chat_messages(group), tools, add_generation_prompt=True)
    # The rendered text carries its own special tokens; no BOS/EOS added around it.
    return list(tokenizer.encode(text, add_special_tokens=False))


def turn_end_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The token that closes an assistant turn: `<|im_end|>` when the vocabulary has it,
    else the tokenizer's eos."""
    token_id = tokenizer.convert_tokens_to_ids(TURN_END_TOKEN)
    if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
        return (token_id,)
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


_SENTINEL = "relayrl-assistant-content-sentinel"

# The chat template over (messages, add_generation_prompt): `render` with the caller's tools,
# or the caller's own rendering (the gateway's agent endpoint maps the template's refusals to
# its errors).
RenderFn = Callable[[list[dict[str, Any]], bool], str]


def appended_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    last_generated_id: int | None,
    render_fn: RenderFn,
) -> list[int] | None:
    """Tokens between an assistant turn and the next generation when `messages` (any roles)
    follow it: what the template renders after an assistant message, up to and including the
    generation prompt. A closing special token the generation already ends with is not
    repeated. None when the template renders the earlier turns differently once `messages`
    follow (each caller says so in its own terms)."""
    before: list[dict[str, Any]] = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _SENTINEL},
    ]
    head = render_fn(before, False)
    full = render_fn([*before, *messages], True)
    if not full.startswith(head):
        return None
    closing = head[head.rindex(_SENTINEL) + len(_SENTINEL) :]
    added = tokenizer.added_tokens_decoder
    if last_generated_id is not None and last_generated_id in added:
        piece = added[last_generated_id].content
        if closing.startswith(piece):
            closing = closing[len(piece) :]
    # The rendered text carries its own special tokens; no BOS/EOS added around it.
    return list(tokenizer.encode(closing + full[len(head) :], add_special_tokens=False))


def observation_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    tool_outputs: Sequence[str],
    last_generated_id: int | None,
    tools: ToolTable | None = None,
) -> list[int]:
    """Tokens between a generation that called tools and the next generation: what the chat
    template renders after an assistant message when tool messages and the generation prompt
    follow. A closing special token the generation already ends with is not repeated."""
    token_ids = appended_token_ids(
        tokenizer,
        [{"role": "tool", "content": output} for output in tool_outputs],
        last_generated_id,
        lambda messages, add_generation_prompt: render(
            tokenizer, messages, tools, add_generation_prompt
        ),
    )
    if token_ids is None:
        raise ValueError(
            "the chat template renders earlier turns differently once a tool turn follows; "
            "tool_agent cannot append observations to the sampled tokens with it"
        )
    return token_ids
