"""Built-in tasks' prompt records: deterministic per seed (across processes too), train and
held-out splits that never share a question (nor does the warm start use a held-out one),
arith answers that equal the expression, lookup labels that hold every key the question names
and nothing of it in the text, records the trainer's prompt feeder accepts, knob checks."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.conversation.tools import evaluate_expression
from relayrl.tasks import SPLITS, TASKS, ArithTask, LookupTask, Task, split_of, write_jsonl
from relayrl.trainer.feeder import load_prompts

TASK_NAMES = sorted(TASKS)
KEY_RE = re.compile(r"key (k\d+)")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_same_seed_same_records_and_longer_lists_extend_shorter(name: str) -> None:
    task = TASKS[name]
    for split in SPLITS:
        records = task.prompts(split, 50, seed=3)
        assert records == task.prompts(split, 50, seed=3)
        assert task.prompts(split, 20, seed=3) == records[:20]
        assert task.prompts(split, 50, seed=4) != records
    assert task.sft_examples(10, seed=3) == task.sft_examples(10, seed=3)
    assert task.sft_examples(10, seed=3) != task.sft_examples(10, seed=4)


def test_records_do_not_depend_on_the_python_process() -> None:
    code = (
        "import json; from relayrl.tasks import TASKS; "
        "print(json.dumps([t.prompts(s, 5, 7) for t in TASKS.values() for s in ('train', "
        "'heldout')]))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    expected = [t.prompts(s, 5, 7) for t in TASKS.values() for s in ("train", "heldout")]
    assert json.loads(outputs.pop()) == expected


@pytest.mark.parametrize("name", TASK_NAMES)
def test_train_and_heldout_never_share_a_question(name: str) -> None:
    task = TASKS[name]
    train = task.questions("train", 2000, seed=0)
    heldout = task.questions("heldout", 300, seed=0)
    sft = task.questions("train", 500, seed=0, stream="sft")
    heldout_keys = {key for q in heldout for key in q.split_keys}
    # Not even a canonical form in common (`12 + 7` vs `7 + 12`, or the values of a lookup).
    assert not heldout_keys & {key for q in train + sft for key in q.split_keys}
    assert not {q.text for q in heldout} & {q.text for q in train + sft}
    for split, questions in (("train", train + sft), ("heldout", heldout)):
        assert all(
            split_of(key, task.heldout_fraction) == split for q in questions for key in q.split_keys
        )
        assert len({q.identity for q in questions[:300]}) == len(questions[:300])  # distinct


def test_commuted_sums_are_one_question() -> None:
    task = ArithTask(operators=("+",))
    for question in task.questions("heldout", 100, seed=1):
        a, b = re.match(r"What is (\d+) \+ (\d+)\?", question.text).groups()  # type: ignore[union-attr]
        assert question.split_keys == (f"{min(a, b, key=str)} + {max(a, b, key=str)}",)


def test_a_split_that_runs_out_of_questions_says_so() -> None:
    tiny = ArithTask(max_digits=1, operators=("+",))  # 55 unordered pairs of digits in all
    with pytest.raises(ValueError, match="distinct train questions"):
        tiny.prompts("train", 100, seed=0)
    with pytest.raises(ValueError, match="split must be one of"):
        tiny.prompts("test", 1, seed=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "task",
    [
        ArithTask(),
        ArithTask(max_digits=3, num_operations=3, allow_negative=True),
        ArithTask(operators=("*",), max_factor=30),
        ArithTask(operators=("-",), num_operations=2, max_digits=2),
    ],
    ids=["default", "3-digit-3-ops", "times-30", "minus-chain"],
)
def test_arith_answer_is_the_value_of_the_expression(task: ArithTask) -> None:
    for record in task.prompts("train", 200, seed=0):
        expression = re.fullmatch(
            r"What is (.+)\?\nEnd your reply with: Answer: <integer>", record["prompt"]
        ).group(1)  # type: ignore[union-attr]
        operators = re.findall(r" ([-+*]) ", expression)
        operands = [int(x) for x in re.split(r" [-+*] ", expression)]
        assert len(operators) == task.num_operations and set(operators) <= set(task.operators)
        assert all(0 <= x < 10**task.max_digits for x in operands)
        for i, operator in enumerate(operators):
            if operator == "*":
                assert 2 <= operands[i] <= task.max_factor
                assert 2 <= operands[i + 1] <= task.max_factor
        assert record["ground_truth"] == str(evaluate_expression(expression))
        assert task.allow_negative or int(record["ground_truth"]) >= 0
        assert (record["data_source"], record["agent"]) == ("arith", "single_turn")
        assert "labels" not in record


@pytest.mark.parametrize(
    "task",
    [LookupTask(), LookupTask(num_keys=1), LookupTask(num_keys=3, allow_negative=True)],
    ids=["default", "one-key", "three-keys"],
)
def test_lookup_labels_hold_every_key_and_the_answer_is_computed_from_them(
    task: LookupTask,
) -> None:
    for record in task.prompts("train", 200, seed=0):
        question = record["prompt"].splitlines()[0]
        keys = KEY_RE.findall(question)
        assert len(keys) == task.num_keys == len(set(keys))
        assert set(record["labels"]) == {f"lookup:{key}" for key in keys}
        # The value of each key is only in the labels, never in the text.
        assert not re.findall(r"(?<![k\d])\d+", record["prompt"])
        words = re.findall(r" (plus|minus) ", question)
        values = [record["labels"][f"lookup:{key}"] for key in keys]
        signs = ["+" if word == "plus" else "-" for word in words]
        expression = " ".join(
            [values[0], *(f"{s} {v}" for s, v in zip(signs, values[1:], strict=True))]
        )
        assert record["ground_truth"] == str(evaluate_expression(expression))
        assert all(0 <= int(v) <= task.max_value for v in values)
        assert (record["data_source"], record["agent"]) == ("arith", "tool_agent")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_the_trainer_feeder_reads_the_written_records(name: str, tmp_path: Path) -> None:
    task = TASKS[name]
    records = task.prompts("train", 20, seed=0)
    path = tmp_path / "data" / "prompts.jsonl"
    assert write_jsonl(records, path) == 20
    assert [p.name for p in path.parent.iterdir()] == ["prompts.jsonl"]  # no scratch left
    loaded = load_prompts(path)
    for record, prompt in zip(records, loaded, strict=True):
        assert prompt.messages == (("user", record["prompt"]),)
        assert (prompt.ground_truth, prompt.data_source) == (record["ground_truth"], "arith")
        assert prompt.agent == task.agent
        assert dict(prompt.labels) == record.get("labels", {})


@pytest.mark.parametrize(
    ("cls", "knobs"),
    [
        (ArithTask, {"max_digits": 0}),
        (ArithTask, {"operators": ("/",)}),
        (ArithTask, {"num_operations": 9}),
        (ArithTask, {"heldout_fraction": 1.0}),
        (LookupTask, {"num_keys": 3, "num_key_names": 2}),
        (LookupTask, {"operations": ("times",)}),
        (LookupTask, {"tool_schemas": ()}),
    ],
)
def test_bad_knobs_are_refused(cls: type[Task], knobs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        cls(**knobs)


def test_the_table_holds_default_tasks_under_their_names() -> None:
    assert {name: type(task) for name, task in TASKS.items()} == {
        "arith": ArithTask,
        "lookup": LookupTask,
    }
    assert all(task.name == name for name, task in TASKS.items())
    assert dataclasses.replace(TASKS["arith"], max_digits=3).max_digits == 3
