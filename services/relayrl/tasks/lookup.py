"""`lookup`: multi-turn tool use. "What is the value of key k7 plus the value of key k12?": the
values exist only in the group's labels (`lookup:k7` -> "23"), which the gateway's `lookup` tool
returns, so the policy must call it, read the answers and add them up (`Answer: 64`).

The rewarded reply, as the gateway's `tool_agent` rolls it out:
    turn 1 (generated)  <tool_call>\\n{"name": "lookup", "arguments": {"key": "k7"}}\\n</tool_call>
                        \\n<tool_call>\\n{... "k12"}\\n</tool_call><|im_end|>
    observation         \\n<|im_start|>user\\n<tool_response>\\n{"result": "23"}\\n</tool_response>
                        ...<|im_end|>\\n<|im_start|>assistant\\n
    turn 2 (generated)  Answer: 64<|im_end|>
The warm start has one SFT example per generated turn. `relayrl-trainer sft` renders prompts
without tools, while `tool_agent` renders them with the gateway's tool table; so every example
starts with a system message holding exactly the text the chat template writes for those tools
(`tools_system_prompt`), which makes both renderings the same tokens.

Scored by the `arith` rule (data_source "arith"): the last `Answer:` of the whole response.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from relayrl.conversation.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from relayrl.conversation.tools import LOOKUP_LABEL_PREFIX, Lookup, ToolTable, result_message
from relayrl.models.tokenizer import CHAT_TEMPLATE, IM_END, IM_START
from relayrl.tasks.arith import canonical_expression, expression_text, integer_value
from relayrl.tasks.base import ANSWER_INSTRUCTION, Question, Record, Task

OPERATION_WORDS = {"plus": "+", "minus": "-"}
TOOL_HINT = "Use the lookup tool to get each value."


def tools_system_prompt(
    tool_schemas: Sequence[Mapping[str, Any]], chat_template: str = CHAT_TEMPLATE
) -> str:
    """The system message the chat template writes when it is given `tool_schemas` (Qwen2's:
    default system prompt, the tools' signatures, the `<tool_call>` format), rendered by the
    same Jinja renderer `apply_chat_template` uses."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "?"}]],
        tools=[dict(schema) for schema in tool_schemas],
        chat_template=chat_template,
        add_generation_prompt=False,
    )
    head = f"{IM_START}system\n"
    if not rendered[0].startswith(head):
        raise ValueError("the chat template does not open with a system turn when given tools")
    return rendered[0][len(head) : rendered[0].index(IM_END)]


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as the chat template writes it and `parse_tool_calls` reads it."""
    call = json.dumps({"name": name, "arguments": dict(arguments)})
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


@dataclass(frozen=True)
class LookupTask(Task):
    """`num_keys` keys out of k1..k`num_key_names`, values 0..`max_value`, joined by words from
    `operations`. A question belongs to a split only if both its text (which keys) and its
    arithmetic (which values) hash there, so held-out questions are new in both respects; the
    arithmetic uses `arith`'s canonical form, so it is held out for both tasks alike.

    `tool_schemas` must be what the gateway offers (its ToolTable's schemas, in order); None
    takes a gateway with the default table (the built-ins, `ToolTable().schemas()`)."""

    name: ClassVar[str] = "lookup"
    agent: ClassVar[str] = "tool_agent"

    num_keys: int = 2
    num_key_names: int = 20
    max_value: int = 99
    operations: tuple[str, ...] = tuple(OPERATION_WORDS)
    allow_negative: bool = False
    tool_schemas: tuple[Mapping[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_keys <= 4:
            raise ValueError(f"num_keys must be in [1, 4], got {self.num_keys}")
        if not self.num_keys <= self.num_key_names <= 999:
            raise ValueError(
                f"num_key_names must be in [num_keys={self.num_keys}, 999], "
                f"got {self.num_key_names}"
            )
        if not 1 <= self.max_value <= 10**6:
            raise ValueError(f"max_value must be in [1, 1000000], got {self.max_value}")
        if not self.operations or set(self.operations) - set(OPERATION_WORDS):
            raise ValueError(f"operations must be a non-empty subset of {tuple(OPERATION_WORDS)}")
        names = {schema.get("function", {}).get("name") for schema in self.offered_tools}
        if Lookup.name not in names:
            raise ValueError(f"tool_schemas must offer the `{Lookup.name}` tool")

    @property
    def offered_tools(self) -> Sequence[Mapping[str, Any]]:
        """The tool schemas the gateway shows the policy."""
        return self.tool_schemas if self.tool_schemas is not None else ToolTable().schemas()

    @cached_property
    def system_prompt(self) -> str:
        """The system message of every SFT example (see `tools_system_prompt`)."""
        return tools_system_prompt(self.offered_tools)

    def draw(self, rng: random.Random) -> Question:
        while True:
            keys = [f"k{i}" for i in rng.sample(range(1, self.num_key_names + 1), self.num_keys)]
            values = [rng.randint(0, self.max_value) for _ in keys]
            words = [rng.choice(self.operations) for _ in keys[1:]]
            symbols = [OPERATION_WORDS[word] for word in words]
            answer = integer_value(expression_text(values, symbols))
            if answer >= 0 or self.allow_negative:
                break
        terms = [f"the value of key {key}" for key in keys]
        question = " ".join(
            [terms[0], *(f"{w} {t}" for w, t in zip(words, terms[1:], strict=True))]
        )
        return Question(
            text=f"What is {question}?\n{TOOL_HINT}\n{ANSWER_INSTRUCTION}",
            answer=answer,
            split_keys=(
                f"lookup:{canonical_expression(keys, symbols)}",
                canonical_expression(values, symbols),
            ),
            labels={LOOKUP_LABEL_PREFIX + k: str(v) for k, v in zip(keys, values, strict=True)},
        )

    def sft_turns(self, question: Question) -> list[Record]:
        """Turn 1 calls `lookup` once per key (all in one generation, as the template writes
        several calls); turn 2 reads the tool answers and gives the final answer."""
        keys = [label.removeprefix(LOOKUP_LABEL_PREFIX) for label in question.labels]
        calls = "\n".join(tool_call_text(Lookup.name, {"key": key}) for key in keys)
        opening = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": question.text},
        ]
        observations = [
            {"role": "tool", "content": result_message(value)} for value in question.labels.values()
        ]
        return [
            {"messages": opening, "answer": calls},
            {
                "messages": [*opening, {"role": "assistant", "content": calls}, *observations],
                "answer": f"Answer: {question.answer}",
            },
        ]
