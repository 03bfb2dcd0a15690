"""Built-in tasks against the tiny model's real tokenizer and the real agent loops: every
prompt and warm-start example is plain text the tokenizer round-trips; each SFT example's
prompt is token for token what the gateway's agent loop sends the engine at that turn, and
replaying the SFT answers as the engine's output gives a rollout the reward rule rewards."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from relayrl.conversation.tools import ToolTable
from relayrl.gateway.agents import AgentContext, build_agent_loops
from relayrl.inference.client import Generation, SamplingOptions, VersionSpan
from relayrl.proto.common.v1 import common_pb2
from relayrl.tasks import TASKS, Task, score, tools_system_prompt, write_jsonl
from relayrl.trainer.feeder import PromptRecord, load_prompts
from relayrl.trainer.sft import SftConfig, load_examples

TASK_NAMES = sorted(TASKS)
PLAIN_CHARACTERS = set(string.printable) - set("\t\r\x0b\x0c")
# The gateway's defaults (RolloutConfig.max_turns, max_response_tokens).
GATEWAY_MAX_TURNS = 4
GATEWAY_MAX_RESPONSE_TOKENS = 512


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def rendered_prompt(tokenizer: PreTrainedTokenizerBase, task: Task, text: str) -> str:
    tools = ToolTable().schemas() if task.agent == "tool_agent" else None
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize("name", TASK_NAMES)
def test_every_prompt_and_answer_is_plain_text_the_tokenizer_round_trips(
    name: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    task = TASKS[name]
    texts = [
        rendered_prompt(tokenizer, task, record["prompt"])
        for split in ("train", "heldout")
        for record in task.prompts(split, 200, seed=0)
    ]
    for example in task.sft_examples(50, seed=0):
        messages = example.get("messages") or [{"role": "user", "content": example["prompt"]}]
        assert set("".join(m["content"] for m in messages) + example["answer"]) <= PLAIN_CHARACTERS
        texts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            + example["answer"]
        )
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_the_tools_system_prompt_renders_like_the_gateways_tools(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    schemas = ToolTable().schemas()
    user = {"role": "user", "content": "What is the value of key k1?"}
    with_tools = tokenizer.apply_chat_template(
        [user], tools=schemas, add_generation_prompt=True, tokenize=False
    )
    as_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": tools_system_prompt(schemas)}, user],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert as_system == with_tools


class ReplaySession:
    """An engine session that answers turn k with the k-th given token ids ("stop")."""

    replica_id = "replay-0"

    def __init__(self, turns: Sequence[Sequence[int]]) -> None:
        self.turns = [tuple(t) for t in turns]
        self.prompts: list[list[int]] = []

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions
    ) -> Generation:
        ids = self.turns[len(self.prompts)]
        self.prompts.append(list(prompt_token_ids))
        assert len(ids) <= sampling.max_tokens
        return Generation("r", ids, (0.0,) * len(ids), "stop", (VersionSpan("0", 0, len(ids)),))


def prompt_group(record: PromptRecord) -> common_pb2.PromptGroup:
    """The group the trainer's feeder makes of a prompts-file line."""
    return common_pb2.PromptGroup(
        uid="g",
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in record.messages],
        data_source=record.data_source,
        ground_truth=record.ground_truth,
        agent=record.agent,
        labels=dict(record.labels),
    )


@pytest.mark.parametrize("name", TASK_NAMES)
def test_sft_examples_are_the_rollout_turns_the_rule_rewards(
    name: str, tokenizer: PreTrainedTokenizerBase, model_dir: Path, tmp_path: Path
) -> None:
    task, num_questions = TASKS[name], 8
    questions = task.questions("train", num_questions, seed=0, stream="sft")
    write_jsonl([task.prompt_record(q) for q in questions], tmp_path / "prompts.jsonl")
    write_jsonl(task.sft_examples(num_questions, seed=0), tmp_path / "sft.jsonl")
    # lookup's prompts carry the gateway's tool block (~570 tokens with the default tools), more
    # than SftConfig' default max_seq_len of 512.
    settings = SftConfig(
        model=model_dir, data=tmp_path / "sft.jsonl", out=tmp_path / "out", max_seq_len=1024
    )
    examples = load_examples(settings, tokenizer)
    num_turns = len(examples) // num_questions
    assert num_turns == {"single_turn": 1, "tool_agent": 2}[task.agent]
    assert max(len(e.input_ids) for e in examples) < settings.max_seq_len  # nothing cut
    loop = build_agent_loops()[task.agent]
    context = AgentContext(
        tokenizer=tokenizer,
        sampling=SamplingOptions(max_tokens=GATEWAY_MAX_RESPONSE_TOKENS),
        max_turns=GATEWAY_MAX_TURNS,
        max_response_tokens=GATEWAY_MAX_RESPONSE_TOKENS,
        tools=ToolTable(),
    )
    records = load_prompts(tmp_path / "prompts.jsonl")
    for index, record in enumerate(records):
        turns = examples[index * num_turns : (index + 1) * num_turns]
        cuts = [int(np.argmax(e.mask)) for e in turns]  # where each SFT answer starts
        prompts = [e.input_ids[:cut].tolist() for e, cut in zip(turns, cuts, strict=True)]
        session = ReplaySession(
            [e.input_ids[cut:].tolist() for e, cut in zip(turns, cuts, strict=True)]
        )
        rollout = asyncio.run(loop.run(prompt_group(record), session, context))
        # What the engine was asked at each turn is exactly what SFT trains as the prompt.
        assert session.prompts == prompts
        assert (rollout.finish_reason, rollout.num_turns) == ("stop", num_turns)
        assert score(task, rollout.response_text, record.ground_truth)
        assert [call["status"] for call in rollout.tool_calls] == ["ok"] * len(record.labels)
