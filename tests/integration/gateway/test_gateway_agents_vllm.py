"""Agent loops against a real vLLM engine (`python -m relayrl.engine` on the tiny model) through
`VllmEngineClient`: single_turn keeps the sampled ids (stop token included) with their
log-probs and weight version; a multi-turn tool_agent rollout on the real engine keeps every
turn's prompt a byte-identical prefix of the next, and its recorded trajectory re-scores to the
same log-probs under transformers (what the trainer will compute).

A random tiny model does not call tools by itself. The turns that must call one are steered
by vLLM's structured outputs (a regex on the generate endpoint's `sampling_params`): the engine
still samples those tokens itself, with its own tokenisation, log-probs and version spans;
later turns are free generations."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relayrl.conversation.tools import ToolTable
from relayrl.engine.process import EngineProcess
from relayrl.gateway.agents import (
    AgentContext,
    ClientSession,
    Rollout,
    SingleTurn,
    ToolAgent,
)
from relayrl.inference.client import Generation, SamplingOptions, VllmEngineClient
from relayrl.proto.common.v1 import common_pb2

pytestmark = pytest.mark.slow

VERSION = "7"
STOP_IDS = {0, 2}  # <|endoftext|> (generation_config's eos) and <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


class SteeredClient(VllmEngineClient):
    """The real client; generate requests take the next regex of `regexes` (if any) as the
    engine's structured-output constraint. SamplingOptions has no such field, so the regex is
    added to the request body on its way out."""

    def __init__(self, base_url: str, regexes: Sequence[str | None] = ()) -> None:
        super().__init__(base_url, name="engine-0")
        self.regexes = list(regexes)

    async def _call(self, method: str, path: str, *, body: Any = None, **kwargs: Any) -> Any:
        if path == "/inference/v1/generate" and self.regexes:
            regex = self.regexes.pop(0)
            if regex is not None:
                body["sampling_params"]["structured_outputs"] = {"regex": regex}
        return await super()._call(method, path, body=body, **kwargs)


class RecordingSession(ClientSession):
    """Keeps every turn's prompt and the engine's answer."""

    def __init__(self, client: VllmEngineClient, session_id: str) -> None:
        super().__init__(client, session_id)
        self.prompts: list[list[int]] = []
        self.generations: list[Generation] = []

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions
    ) -> Generation:
        self.prompts.append(list(prompt_token_ids))
        generation = await super().generate(prompt_token_ids, sampling)
        self.generations.append(generation)
        return generation


def roll_out(
    engine: EngineProcess,
    loop: SingleTurn | ToolAgent,
    group: common_pb2.PromptGroup,
    context: AgentContext,
    regexes: Sequence[str | None] = (),
) -> tuple[Rollout, RecordingSession]:
    async def main() -> tuple[Rollout, RecordingSession]:
        client = SteeredClient(engine.url, regexes)
        try:
            await client.set_weight_version(VERSION)
            session = RecordingSession(client, f"{group.uid}_0")
            return await loop.run(group, session, context), session
        finally:
            await client.close()

    return asyncio.run(main())


def context(
    tokenizer: PreTrainedTokenizerBase, *, max_tokens: int = 48, max_turns: int = 4, seed: int = 1
) -> AgentContext:
    return AgentContext(
        tokenizer=tokenizer,
        sampling=SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=seed),
        max_turns=max_turns,
        max_response_tokens=400,
        tools=ToolTable(),
    )


def question(text: str, agent: str, **labels: str) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=f"{agent}-q",
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        agent=agent,
        labels=labels,
    )


def call_regex(name: str, **arguments: Any) -> str:
    text = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    return re.escape(text)


def check_consistent(rollout: Rollout) -> None:
    n = len(rollout.response_token_ids)
    assert len(rollout.response_mask) == len(rollout.rollout_logprobs) == n
    position = 0
    for span in rollout.spans:
        assert span.start == position < span.end
        assert set(rollout.response_mask[span.start : span.end]) == {int(span.generated)}
        if span.generated:
            assert span.policy_version == int(VERSION) and span.replica == "engine-0"
        else:
            assert span.policy_version == -1
        position = span.end
    assert position == n


def rescored_logprobs(model_dir: Path, rollout: Rollout) -> list[float]:
    """Log-probs of the response tokens under transformers, teacher-forced on the recorded
    trajectory (what the trainer recomputes)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = rollout.prompt_token_ids + rollout.response_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(ids[1:])
    per_token = logprobs.gather(1, targets[:, None])[:, 0]
    return per_token[len(rollout.prompt_token_ids) - 1 :].tolist()


# --- single_turn -----------------------------------------------------------------------------


def test_single_turn_keeps_sampled_ids_logprobs_and_version(
    engine: EngineProcess, tokenizer: PreTrainedTokenizerBase, model_dir: Path
) -> None:
    group = question("What is 2 + 3?", "single_turn")
    rollout, session = roll_out(engine, SingleTurn(), group, context(tokenizer, max_tokens=24))
    check_consistent(rollout)
    (generation,) = session.generations
    assert rollout.response_token_ids == list(generation.token_ids)
    assert len(rollout.rollout_logprobs) == len(rollout.response_token_ids) > 0
    assert rollout.rollout_logprobs == list(generation.logprobs)
    assert rollout.num_turns == 1 and rollout.finish_reason in {"stop", "length"}
    if rollout.finish_reason == "length":
        assert len(rollout.response_token_ids) == 24
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert rollout.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert rollout.rollout_logprobs == pytest.approx(
        rescored_logprobs(model_dir, rollout), abs=2e-3
    )


def test_the_stop_token_stays_in_the_returned_ids(
    engine: EngineProcess, tokenizer: PreTrainedTokenizerBase
) -> None:
    group = question("What is 2 + 3?", "single_turn")
    rollout, _ = roll_out(
        engine, SingleTurn(), group, context(tokenizer), regexes=[re.escape("Answer: 5")]
    )
    check_consistent(rollout)
    assert rollout.finish_reason == "stop"
    # vLLM returns the stop token it sampled as the last id (with its log-prob); the text
    # a reward reads has it skipped.
    assert rollout.response_token_ids[-1] in STOP_IDS
    assert len(rollout.rollout_logprobs) == len(rollout.response_token_ids)
    assert rollout.response_text == "Answer: 5"


# --- tool_agent ------------------------------------------------------------------------------


def test_a_multi_turn_tool_rollout_on_the_real_engine(
    engine: EngineProcess, tokenizer: PreTrainedTokenizerBase, model_dir: Path
) -> None:
    group = question(
        "Look up the price, then compute 6 * 7.", "tool_agent", **{"lookup:price": "9"}
    )
    regexes = [call_regex("lookup", key="price"), call_regex("calculator", expression="6 * 7")]
    rollout, session = roll_out(
        engine, ToolAgent(), group, context(tokenizer, max_tokens=48, max_turns=3), regexes
    )
    check_consistent(rollout)

    assert rollout.num_turns == 3 == len(session.generations)
    assert [(c["name"], c["status"]) for c in rollout.tool_calls[:2]] == [
        ("lookup", "ok"),
        ("calculator", "ok"),
    ]
    # Every turn's prompt is the previous prompt + the engine's ids for that turn, verbatim.
    for k in range(len(session.prompts) - 1):
        head = session.prompts[k] + list(session.generations[k].token_ids)
        assert session.prompts[k + 1][: len(head)] == head
    # The response is the engine's ids and the observations, interleaved, nothing else.
    generated = [s for s in rollout.spans if s.generated]
    for span, generation in zip(generated, session.generations, strict=True):
        assert rollout.response_token_ids[span.start : span.end] == list(generation.token_ids)
        assert rollout.rollout_logprobs[span.start : span.end] == list(generation.logprobs)
    assert sorted({s.turn for s in generated}) == [0, 1, 2]
    # The steered turns ended on a stop token the engine sampled and returned.
    assert all(g.token_ids[-1] in STOP_IDS for g in session.generations[:2])
    observed = [s for s in rollout.spans if not s.generated]
    assert [s.turn for s in observed] == [0, 1]
    texts = [tokenizer.decode(rollout.response_token_ids[s.start : s.end]) for s in observed]
    assert '<tool_response>\n{"result": "9"}\n</tool_response>' in texts[0]
    assert '<tool_response>\n{"result": 42}\n</tool_response>' in texts[1]
    assert all(t.endswith("<|im_end|>\n<|im_start|>assistant\n") for t in texts)
    # Re-scoring the recorded trajectory gives the engine's log-probs on the free turn: the
    # observations and the steered turns before it left the context exactly as sampled. (A
    # steered turn's log-probs are those of the grammar-masked distribution, not the model's.)
    rescored = rescored_logprobs(model_dir, rollout)
    for span in generated:
        engine_logprobs = rollout.rollout_logprobs[span.start : span.end]
        if span.turn < len(regexes):
            assert all(lp <= 0.0 for lp in engine_logprobs)
        else:
            assert engine_logprobs == pytest.approx(rescored[span.start : span.end], abs=2e-3)
