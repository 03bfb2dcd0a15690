"""Agent loops and tools on a scripted in-process engine session and the tiny model's real
tokenizer: single_turn and tool_agent trajectories (masks, spans, byte-identical prefixes
across turns, the chat template's rendering), budgets, the policy's mistakes vs tool
failures, the built-in tools' behaviour and safety, plug-ins by dotted path."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from relayrl.conversation import rendering
from relayrl.conversation.rendering import observation_token_ids, prompt_token_ids
from relayrl.conversation.tool_calls import parse_tool_calls
from relayrl.conversation.tools import (
    MAX_INT_BITS,
    Tool,
    ToolFailure,
    ToolTable,
    evaluate_expression,
)
from relayrl.gateway.agent_http import AgentError, ErrorKind
from relayrl.gateway.agent_http.template import appended_token_ids
from relayrl.gateway.agents import (
    AgentContext,
    AgentLoop,
    EngineSession,
    Rollout,
    SingleTurn,
    ToolAgent,
    build_agent_loops,
)
from relayrl.inference.client import EngineUnavailable, Generation, SamplingOptions, VersionSpan
from relayrl.models.tiny import TinyModelConfig, init_model
from relayrl.proto.common.v1 import common_pb2

IM_END = 2
ENDOFTEXT = 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    directory = tmp_path_factory.mktemp("tiny") / "model"
    init_model(directory, TinyModelConfig())
    return AutoTokenizer.from_pretrained(directory)


# --- a scripted engine session ---------------------------------------------------------------


class ScriptedSession:
    """Answers turn k with the k-th scripted token ids; records every request."""

    def __init__(
        self,
        turns: Sequence[Sequence[int]],
        *,
        finish_reasons: Sequence[str] | None = None,
        version: str = "5",
        replica_id: str = "fake-0",
    ) -> None:
        self.turns = [list(t) for t in turns]
        self.finish_reasons = list(finish_reasons or ["stop"] * len(turns))
        self.version = version
        self.replica_id = replica_id
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingOptions] = []

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions
    ) -> Generation:
        turn = len(self.prompts)
        self.prompts.append(list(prompt_token_ids))
        self.samplings.append(sampling)
        ids = self.turns[turn][: sampling.max_tokens]
        finish = self.finish_reasons[turn]
        if len(ids) < len(self.turns[turn]):
            finish = "length"
        logprobs = tuple(-0.01 * (turn + 1) * (i + 1) for i in range(len(ids)))
        return Generation(
            f"r{turn}",
            tuple(ids),
            logprobs,
            finish,
            (VersionSpan(self.version, 0, len(ids)),),
        )


def turn(tokenizer: PreTrainedTokenizerBase, text: str, end: int | None = IM_END) -> list[int]:
    """A generation's tokens: the text's canonical tokens, then the stop token."""
    return tokenizer.encode(text, add_special_tokens=False) + ([end] if end is not None else [])


def call_text(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def group(
    question: str = "What is 6 * 7?", agent: str = "tool_agent", **labels: str
) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid="g1",
        messages=[common_pb2.ChatMessage(role="user", content=question)],
        agent=agent,
        labels=labels,
    )


def context(
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_turns: int = 4,
    max_response_tokens: int = 400,
    max_tokens: int = 200,
    tools: ToolTable | None = None,
) -> AgentContext:
    return AgentContext(
        tokenizer=tokenizer,
        sampling=SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=3),
        max_turns=max_turns,
        max_response_tokens=max_response_tokens,
        tools=tools or ToolTable(),
    )


def run(loop: AgentLoop, prompt_group, session, ctx) -> Rollout:  # type: ignore[no-untyped-def]
    return asyncio.run(loop.run(prompt_group, session, ctx))


def check_consistent(rollout: Rollout) -> None:
    """Masks, log-probs and spans agree and spans tile the response in order."""
    n = len(rollout.response_token_ids)
    assert len(rollout.response_mask) == len(rollout.rollout_logprobs) == n
    position = 0
    for span in rollout.spans:
        assert span.start == position < span.end
        assert set(rollout.response_mask[span.start : span.end]) == {int(span.generated)}
        if not span.generated:
            assert span.policy_version == -1 and not any(
                rollout.rollout_logprobs[span.start : span.end]
            )
        position = span.end
    assert position == n


# --- single_turn -----------------------------------------------------------------------------


def test_single_turn_response_is_the_sampled_tokens_including_the_stop_token(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    generated = turn(tokenizer, "Answer: 42")
    session = ScriptedSession([generated], version="7")
    ctx = context(tokenizer, max_response_tokens=64, max_tokens=200)
    rollout = run(SingleTurn(), group(agent="single_turn"), session, ctx)

    assert rollout.response_token_ids == generated and generated[-1] == IM_END
    assert rollout.response_mask == bytearray([1] * len(generated))
    assert rollout.rollout_logprobs == pytest.approx(
        [-0.01 * (i + 1) for i in range(len(generated))]
    )
    (span,) = rollout.spans
    assert (span.start, span.end, span.policy_version, span.turn, span.replica, span.generated) == (
        (0, len(generated), 7, 0, "fake-0", True)
    )
    assert (rollout.finish_reason, rollout.num_turns, rollout.tool_calls) == ("stop", 1, [])
    assert rollout.response_text == "Answer: 42"
    (sampling,) = session.samplings
    assert sampling.max_tokens == 64 and IM_END in sampling.stop_token_ids
    assert sampling.seed == 3 and sampling.temperature == 1.0
    # single_turn renders no tool schemas into the prompt.
    assert "calculator" not in tokenizer.decode(rollout.prompt_token_ids)


def test_version_spans_map_to_policy_versions_and_gaps_get_minus_one(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    class SplitVersions(ScriptedSession):
        async def generate(self, prompt_token_ids, sampling):  # type: ignore[no-untyped-def]
            generation = await super().generate(prompt_token_ids, sampling)
            spans = (VersionSpan("3", 0, 2), VersionSpan("4", 2, 5), VersionSpan("default", 5, 6))
            return Generation(
                generation.request_id,
                generation.token_ids,
                generation.logprobs,
                generation.finish_reason,
                spans,
            )

    generated = list(range(100, 108))
    session = SplitVersions([generated], finish_reasons=["length"])
    rollout = run(SingleTurn(), group(agent="single_turn"), session, context(tokenizer))
    check_consistent(rollout)
    assert [(s.start, s.end, s.policy_version) for s in rollout.spans] == [
        (0, 2, 3),
        (2, 5, 4),
        (5, 6, -1),  # a non-integer version label
        (6, 8, -1),  # no version span covers these tokens
    ]
    assert rollout.finish_reason == "length"


# --- tool_agent ------------------------------------------------------------------------------


def test_tool_agent_trajectory_masks_spans_and_byte_identical_prefixes(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    texts = [
        call_text("lookup", key="price"),
        "Now multiply.\n" + call_text("calculator", expression="6 * 7"),
        "The price is 9 and 6 * 7 = 42.\nAnswer: 42",
    ]
    turns = [turn(tokenizer, text) for text in texts]
    session = ScriptedSession(turns)
    prompt_group = group(**{"lookup:price": "9"})
    rollout = run(ToolAgent(), prompt_group, session, context(tokenizer))
    check_consistent(rollout)

    assert (rollout.finish_reason, rollout.num_turns) == ("stop", 3)
    # Turn k+1's prompt is turn k's prompt + turn k's tokens, as returned, + an observation.
    for k in range(2):
        head = session.prompts[k] + turns[k]
        assert session.prompts[k + 1][: len(head)] == head
    assert session.prompts[0] == rollout.prompt_token_ids
    assert rollout.prompt_token_ids + rollout.response_token_ids == session.prompts[2] + turns[2]

    generated = [s for s in rollout.spans if s.generated]
    observed = [s for s in rollout.spans if not s.generated]
    assert [(s.turn, s.end - s.start, s.policy_version) for s in generated] == [
        (0, len(turns[0]), 5),
        (1, len(turns[1]), 5),
        (2, len(turns[2]), 5),
    ]
    assert [s.turn for s in observed] == [0, 1] and all(not s.replica for s in observed)
    for span, k in zip(generated, range(3), strict=True):
        assert rollout.response_token_ids[span.start : span.end] == turns[k]
        assert rollout.rollout_logprobs[span.start : span.end] == pytest.approx(
            [-0.01 * (k + 1) * (i + 1) for i in range(len(turns[k]))]
        )

    assert [(c["name"], c["arguments"], c["status"]) for c in rollout.tool_calls] == [
        ("lookup", {"key": "price"}, "ok"),
        ("calculator", {"expression": "6 * 7"}, "ok"),
    ]
    assert '{"result": "9"}' in rollout.response_text and '{"result": 42}' in rollout.response_text
    assert rollout.response_text.endswith("Answer: 42")
    assert rollout.generate_s >= 0 and rollout.tool_s >= 0


def test_tool_agent_trajectory_is_what_the_chat_template_renders(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    texts = [call_text("calculator", expression="2 + 3"), "It is 5.\nAnswer: 5"]
    session = ScriptedSession([turn(tokenizer, t) for t in texts])
    tools = ToolTable()
    rollout = run(ToolAgent(), group("What is 2 + 3?"), session, context(tokenizer, tools=tools))

    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": texts[0]},
        {"role": "tool", "content": '{"result": 5}'},
    ]
    rendered = tokenizer.apply_chat_template(
        conversation, tools=tools.schemas(), add_generation_prompt=True, tokenize=False
    )
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    expected += turn(tokenizer, texts[1])
    # Canonical tokens in, so even re-tokenising the rendered conversation gives the same ids.
    assert rollout.prompt_token_ids + rollout.response_token_ids == expected
    observation = rollout.response_token_ids[rollout.spans[1].start : rollout.spans[1].end]
    assert tokenizer.decode(observation) == (
        "\n<|im_start|>user\n<tool_response>\n"
        '{"result": 5}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


def test_several_calls_in_one_turn_share_one_tool_turn(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    first = call_text("calculator", expression="1 + 1") + "\n" + call_text("lookup", key="x")
    session = ScriptedSession([turn(tokenizer, first), turn(tokenizer, "done")])
    rollout = run(ToolAgent(), group(**{"lookup:x": "ex"}), session, context(tokenizer))
    check_consistent(rollout)
    span = rollout.spans[1]
    observation = tokenizer.decode(rollout.response_token_ids[span.start : span.end])
    assert observation == (
        '\n<|im_start|>user\n<tool_response>\n{"result": 2}\n</tool_response>\n'
        '<tool_response>\n{"result": "ex"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


def test_sampled_tokens_are_kept_verbatim_even_when_not_canonical(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # A real engine under a grammar spelled "<tool_call>" byte by byte and stopped on
    # <|endoftext|>: the trajectory keeps those ids; the observation closes the turn itself.
    text = call_text("calculator", expression="2 + 3")
    spelled = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    first = [*spelled, ENDOFTEXT]
    assert first[:-1] != tokenizer.encode(text, add_special_tokens=False)
    session = ScriptedSession([first, turn(tokenizer, "5")])
    rollout = run(ToolAgent(), group(), session, context(tokenizer))
    check_consistent(rollout)
    assert rollout.response_token_ids[: len(first)] == first
    assert session.prompts[1][: len(session.prompts[0]) + len(first)] == session.prompts[0] + first
    observation = rollout.response_token_ids[rollout.spans[1].start : rollout.spans[1].end]
    assert tokenizer.decode(observation).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")
    assert rollout.tool_calls[0]["status"] == "ok"


def test_max_turns_stops_a_policy_that_keeps_calling_tools(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    calling = turn(tokenizer, call_text("calculator", expression="1 + 1"))
    session = ScriptedSession([calling] * 5)
    rollout = run(ToolAgent(), group(), session, context(tokenizer, max_turns=3))
    check_consistent(rollout)
    assert (rollout.finish_reason, rollout.num_turns, len(session.prompts)) == ("max_turns", 3, 3)
    assert [c["status"] for c in rollout.tool_calls] == ["ok", "ok", "not_run"]
    assert rollout.spans[-1].generated and rollout.spans[-1].turn == 2


def test_max_response_tokens_shrinks_the_last_generation_and_ends_with_length(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    calling = turn(tokenizer, call_text("calculator", expression="1 + 1"))
    observation_len = len(observation_token_ids(tokenizer, ['{"result": 2}'], IM_END))
    budget = len(calling) + observation_len + 5
    session = ScriptedSession([calling, list(range(100, 150))])
    rollout = run(ToolAgent(), group(), session, context(tokenizer, max_response_tokens=budget))
    check_consistent(rollout)
    assert session.samplings[0].max_tokens == budget  # the budget is below the per-turn cap
    assert session.samplings[1].max_tokens == 5
    assert len(rollout.response_token_ids) == budget
    assert (rollout.finish_reason, rollout.num_turns) == ("length", 2)


def test_tool_answers_that_do_not_fit_the_budget_end_the_rollout(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    calling = turn(tokenizer, call_text("calculator", expression="1 + 1"))
    session = ScriptedSession([calling, turn(tokenizer, "never")])
    budget = len(calling) + 3
    rollout = run(ToolAgent(), group(), session, context(tokenizer, max_response_tokens=budget))
    check_consistent(rollout)
    assert rollout.response_token_ids == calling and len(session.prompts) == 1
    assert (rollout.finish_reason, rollout.num_turns) == ("length", 1)


def test_a_generation_cut_by_length_ends_the_rollout_without_running_its_tools(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    calling = turn(tokenizer, call_text("calculator", expression="1 + 1"))
    session = ScriptedSession([calling], finish_reasons=["length"])
    rollout = run(ToolAgent(), group(), session, context(tokenizer))
    assert (rollout.finish_reason, rollout.tool_calls) == ("length", [])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "needs a name"),
        ("<tool_call>\n" + '{"name": "calculator", "arguments": {"expression": "1+', "without"),
        (call_text("search", query="x"), "unknown tool 'search'"),
        (call_text("calculator", expr="1"), "missing argument(s): expression"),
        (call_text("calculator", expression=5), "must be of type string"),
        (call_text("calculator", expression="__import__('os')"), "unsupported element Call"),
    ],
)
def test_a_malformed_tool_call_is_answered_and_the_rollout_continues(
    tokenizer: PreTrainedTokenizerBase, text: str, message: str
) -> None:
    session = ScriptedSession([turn(tokenizer, text), turn(tokenizer, "sorry")])
    rollout = run(ToolAgent(), group(), session, context(tokenizer))
    check_consistent(rollout)
    assert (rollout.finish_reason, rollout.num_turns) == ("stop", 2)
    observation = rollout.response_token_ids[rollout.spans[1].start : rollout.spans[1].end]
    decoded = tokenizer.decode(observation)
    assert '<tool_response>\n{"error": ' in decoded and message in decoded
    (record,) = rollout.tool_calls
    assert record["status"] in {"malformed", "unknown_tool", "bad_arguments", "ok"}


def test_too_many_calls_in_one_turn_are_answered_not_run(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    many = "\n".join(call_text("calculator", expression=f"{i} + 1") for i in range(3))
    session = ScriptedSession([turn(tokenizer, many), turn(tokenizer, "ok")])
    ctx = AgentContext(
        tokenizer=tokenizer,
        sampling=SamplingOptions(max_tokens=200),
        max_turns=3,
        max_response_tokens=500,
        tools=ToolTable(),
        max_tool_calls_per_turn=2,
    )
    rollout = run(ToolAgent(), group(), session, ctx)
    assert [c["status"] for c in rollout.tool_calls] == ["ok", "ok", "not_run"]
    assert "too many tool calls" in rollout.response_text


class CrashingTool(Tool):
    name = "crash"
    description = "Always fails."
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    async def call(self, arguments: Mapping[str, Any], group: common_pb2.PromptGroup) -> str:
        raise RuntimeError("disk on fire")


class SlowTool(Tool):
    name = "slow"
    description = "Never answers in time."
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    cancelled: ClassVar[list[bool]] = []

    async def call(self, arguments: Mapping[str, Any], group: common_pb2.PromptGroup) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            SlowTool.cancelled.append(True)
            raise
        return "late"


class EchoTool(Tool):
    name = "echo"
    description = "Says its text back, with the group's uid."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }

    async def call(self, arguments: Mapping[str, Any], group: common_pb2.PromptGroup) -> str:
        return f"{group.uid}: {arguments['text']}"


USER_TOOLS = {
    "crash": f"{__name__}:CrashingTool",
    "slow": f"{__name__}:SlowTool",
    "echo": f"{__name__}:EchoTool",
}


def test_a_crashing_tool_is_an_infrastructure_failure(tokenizer: PreTrainedTokenizerBase) -> None:
    session = ScriptedSession([turn(tokenizer, call_text("crash")), turn(tokenizer, "x")])
    ctx = context(tokenizer, tools=ToolTable(USER_TOOLS))
    with pytest.raises(ToolFailure, match="tool crash crashed: RuntimeError: disk on fire"):
        run(ToolAgent(), group(), session, ctx)


def test_a_tool_past_its_timeout_fails_and_its_siblings_are_cancelled(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    SlowTool.cancelled.clear()
    text = call_text("slow") + call_text("slow") + call_text("crash")
    session = ScriptedSession([turn(tokenizer, text)])
    ctx = context(tokenizer, tools=ToolTable(USER_TOOLS, timeout_s=0.2))
    started = time.monotonic()
    with pytest.raises(ToolFailure, match="crash"):
        run(ToolAgent(), group(), session, ctx)
    assert time.monotonic() - started < 5 and SlowTool.cancelled == [True, True]

    session = ScriptedSession([turn(tokenizer, call_text("slow"))])
    with pytest.raises(ToolFailure, match=r"tool slow did not answer in 0.2 s"):
        run(ToolAgent(), group(), session, ctx)


def test_engine_errors_propagate_unchanged(tokenizer: PreTrainedTokenizerBase) -> None:
    error = EngineUnavailable("replica gone")

    class DeadSession(ScriptedSession):
        async def generate(self, prompt_token_ids, sampling):  # type: ignore[no-untyped-def]
            if self.prompts:
                raise error
            return await super().generate(prompt_token_ids, sampling)

    session = DeadSession([turn(tokenizer, call_text("calculator", expression="1"))])
    with pytest.raises(EngineUnavailable) as caught:
        run(ToolAgent(), group(), session, context(tokenizer))
    assert caught.value is error


def test_parse_tool_calls_reads_both_argument_forms() -> None:
    text = (
        'think <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then '
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
        '<tool_call>{"name": "c"}</tool_call></tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("a", {"x": 1}, None),
        ("b", {"y": 2}, None),
        ("c", {}, None),
    ]
    assert parse_tool_calls("no calls here </tool_call>") == []


def test_a_close_tag_inside_an_argument_does_not_end_the_call() -> None:
    # A forced call's grammar lets a sampled argument hold any text, the close tag included.
    text = '<tool_call>\n{"name": "add", "arguments": {"a": "x</tool_call>y"}}\n</tool_call> ok'
    (call,) = parse_tool_calls(text)
    assert (call.name, call.arguments, call.error) == ("add", {"a": "x</tool_call>y"}, None)


def test_malformed_and_unclosed_calls_carry_their_reason() -> None:
    bad, unclosed = parse_tool_calls('<tool_call>{"name": </tool_call> <tool_call>{"name": "a"}')
    assert bad.error is not None and bad.error.startswith("tool call is not valid JSON")
    assert unclosed.error == "<tool_call> without </tool_call>"
    (nameless,) = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert nameless.error == "tool call needs a name and an arguments object"


# --- tools -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("-4 + +2", -2),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("1.5 * 4", 6.0),
        ("2 ** 4000", 2**4000),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate_expression(expression) == value
    answer = asyncio.run(ToolTable().call("calculator", {"expression": expression}, group()))
    assert json.loads(answer) == {"result": value}


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo pwned')", "unsupported element Call"),
        ("().__class__.__bases__", "unsupported element Attribute"),
        ("x + 1", "unsupported element Name"),
        ("'a' * 3", "unsupported constant 'a'"),
        ("True + 1", "unsupported constant True"),
        ("(lambda: 1)()", "unsupported element Call"),
        ("1 < 2", "unsupported element Compare"),
        ("1 << 5", "unsupported element LShift"),
        ("[1, 2]", "unsupported element List"),
        ("9 ** 9 ** 9", "too large"),
        ("2 ** 10 ** 10", "too large"),
        ("(10 ** 600) * (10 ** 700)", "too large"),
        ("1e308 * 10", "too large"),
        ("1.5 ** 100000", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "not a valid arithmetic expression"),
        ("1" * 201, "longer than 200"),
        ("1, 2", "unsupported element Tuple"),
    ],
)
def test_calculator_refuses_anything_else_with_a_message(expression: str, message: str) -> None:
    started = time.monotonic()
    answer = asyncio.run(ToolTable().call("calculator", {"expression": expression}, group()))
    assert time.monotonic() - started < 1.0
    assert message in json.loads(answer)["error"]
    assert MAX_INT_BITS == 4096


def test_lookup_answers_from_the_groups_labels() -> None:
    table = ToolTable()
    labelled = group(**{"lookup:capital": "Paris", "task": "geo"})
    assert asyncio.run(table.call("lookup", {"key": "capital"}, labelled)) == '{"result": "Paris"}'
    missing = asyncio.run(table.call("lookup", {"key": "task"}, labelled))
    assert json.loads(missing) == {"error": "no value for key 'task'"}


def test_the_table_checks_arguments_and_names_before_calling() -> None:
    table = ToolTable(USER_TOOLS)
    assert table.names == ("calculator", "lookup", "crash", "slow", "echo")

    def call(name: str, arguments: Any) -> str:
        return asyncio.run(table.call(name, arguments, group()))

    assert call("echo", {"text": "hi", "extra": 1}) == "g1: hi"  # no additionalProperties
    assert "unknown argument(s): extra" in call("lookup", {"key": "a", "extra": 1})
    assert "must be a JSON object" in call("lookup", ["a"])
    assert "unknown tool 'nope' (available: calculator, lookup, crash, slow, echo)" in call(
        "nope", {}
    )
    names = [schema["function"]["name"] for schema in ToolTable(enabled=["lookup"]).schemas()]
    assert names == ["lookup"]
    schema = ToolTable().schemas()[0]
    assert schema["type"] == "function" and schema["function"]["parameters"]["required"] == [
        "expression"
    ]


def test_long_tool_output_is_cut() -> None:
    table = ToolTable(USER_TOOLS, max_output_chars=10)
    assert asyncio.run(table.call("echo", {"text": "x" * 50}, group())) == (
        "g1: xxxxxx ...[truncated]"
    )


# --- prompts ---------------------------------------------------------------------------------


def test_prompts_render_messages_or_take_token_ids_as_given(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    messages = group("Hi there")
    ids = prompt_token_ids(messages, tokenizer, None)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids).endswith(
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = tokenizer.decode(prompt_token_ids(messages, tokenizer, ToolTable()))
    assert '"name": "calculator"' in with_tools and "<tools>" in with_tools

    given = common_pb2.PromptGroup(uid="g2", prompt_token_ids=[5, 6, 7], messages=messages.messages)
    assert prompt_token_ids(given, tokenizer, ToolTable()) == [5, 6, 7]
    session = ScriptedSession([turn(tokenizer, "ok")])
    rollout = run(SingleTurn(), given, session, context(tokenizer))
    assert rollout.prompt_token_ids == session.prompts[0] == [5, 6, 7]

    with pytest.raises(ValueError, match="group g3: no prompt"):
        prompt_token_ids(common_pb2.PromptGroup(uid="g3"), tokenizer, None)


def test_a_system_message_and_named_fields_reach_the_template(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    conversation = common_pb2.PromptGroup(
        uid="g4",
        messages=[
            common_pb2.ChatMessage(role="system", content="Be terse."),
            common_pb2.ChatMessage(role="user", content="2+2?"),
        ],
    )
    decoded = tokenizer.decode(prompt_token_ids(conversation, tokenizer, None))
    assert decoded.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")


# --- plug-ins --------------------------------------------------------------------------------


class EchoLoop(AgentLoop):
    name = "echo_loop"

    async def run(
        self, group: common_pb2.PromptGroup, session: EngineSession, context: AgentContext
    ) -> Rollout:
        return await SingleTurn().run(group, session, context)


class NotALoop:
    pass


def test_user_loops_by_dotted_path(tokenizer: PreTrainedTokenizerBase) -> None:
    loops = build_agent_loops({"echo": f"{__name__}:EchoLoop"})
    assert sorted(loops) == ["echo", "single_turn", "tool_agent"]
    assert isinstance(loops["echo"], EchoLoop)
    session = ScriptedSession([turn(tokenizer, "hello")])
    assert run(loops["echo"], group(), session, context(tokenizer)).response_text == "hello"
    assert sorted(build_agent_loops()) == ["single_turn", "tool_agent"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon_here", "not of the form package.module:Attribute"),
        ("relayrl.no_such_module:Loop", "cannot import module 'relayrl.no_such_module'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NotALoop", "is not a subclass of AgentLoop"),
    ],
)
def test_bad_loop_paths_are_refused_by_name(path: str, message: str) -> None:
    with pytest.raises(ValueError, match="agent loop") as caught:
        build_agent_loops({"mine": path})
    assert path in str(caught.value) and message in str(caught.value)


def test_bad_user_tools_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="clashes with the built-in"):
        build_agent_loops({"tool_agent": f"{__name__}:EchoLoop"})
    with pytest.raises(ValueError, match="clashes with the built-in tool"):
        ToolTable({"calculator": f"{__name__}:EchoTool"})
    with pytest.raises(ValueError, match="is named 'echo'; configure it under that name"):
        ToolTable({"say": f"{__name__}:EchoTool"})
    with pytest.raises(ValueError, match=f"{__name__}:EchoLoop' is not a subclass of Tool"):
        ToolTable({"echo_loop": f"{__name__}:EchoLoop"})
    with pytest.raises(ValueError, match="unknown tool"):
        ToolTable(enabled=["calculator", "web"])


def test_plugin_contracts_are_pinned() -> None:
    # User loops and tools are written against these signatures; changing one breaks them.
    assert list(inspect.signature(AgentLoop.run).parameters) == [
        "self",
        "group",
        "session",
        "context",
    ]
    assert list(inspect.signature(Tool.call).parameters) == ["self", "arguments", "group"]
    assert {"name", "description", "parameters"} <= set(Tool.__annotations__)
    assert isinstance(ScriptedSession([]), EngineSession)
    assert [f for f in AgentContext.__dataclass_fields__] == [
        "tokenizer",
        "sampling",
        "max_turns",
        "max_response_tokens",
        "tools",
        "max_tool_calls_per_turn",
    ]


def test_context_bounds(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="max_turns"):
        context(tokenizer, max_turns=0)
    with pytest.raises(ValueError, match="max_response_tokens"):
        context(tokenizer, max_response_tokens=0)


def test_observation_needs_a_template_that_keeps_earlier_turns(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    class Rewriting:
        added_tokens_decoder: ClassVar[dict[int, Any]] = {}

        def apply_chat_template(self, messages, **kwargs):  # type: ignore[no-untyped-def]
            # Like templates that drop earlier reasoning: the history changes with each turn.
            return "|".join(m["content"] for m in reversed(messages))

    with pytest.raises(ValueError, match="renders earlier turns differently"):
        observation_token_ids(Rewriting(), ["x"], None)  # type: ignore[arg-type]


def test_tool_agent_and_agent_endpoint_append_the_same_observation_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """One sentinel algorithm (`rendering.appended_token_ids`) serves the built-in tool loop
    and the agent endpoint; each keeps its own error when the template rewrites history."""
    outputs = ['{"result": 2}', "second"]
    tool_messages = [{"role": "tool", "content": output} for output in outputs]
    for last in (IM_END, ENDOFTEXT, None):
        expected = observation_token_ids(tokenizer, outputs, last)
        assert appended_token_ids(tokenizer, tool_messages, last, None) == expected
    unclosed = tokenizer.decode(observation_token_ids(tokenizer, outputs, None))
    closed = tokenizer.decode(observation_token_ids(tokenizer, outputs, IM_END))
    assert unclosed.startswith("<|im_end|>") and not closed.startswith("<|im_end|>")
    assert closed.endswith("<|im_start|>assistant\n")

    class Rewriting:
        added_tokens_decoder: ClassVar[dict[int, Any]] = {}

        def apply_chat_template(self, messages, **kwargs):  # type: ignore[no-untyped-def]
            return "|".join(m["content"] for m in reversed(messages))

    assert (
        rendering.appended_token_ids(
            Rewriting(),  # type: ignore[arg-type]
            tool_messages,
            None,
            lambda messages, add_generation_prompt: Rewriting().apply_chat_template(messages),
        )
        is None
    )
    with pytest.raises(AgentError, match="cannot append them") as refused:
        appended_token_ids(Rewriting(), tool_messages, None, None)  # type: ignore[arg-type]
    assert refused.value.kind is ErrorKind.INVALID
