"""What `relayrl up` trains on: built-in tasks, a user's dataset files, reasoning-gym tasks, a
user's reward function; every mistake one line before anything starts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from relayrl.tasks import TASKS
from relayrl.up.config import UpConfig
from relayrl.up.prepare import max_tokens
from relayrl.up.wiring import up_reward_settings
from relayrl.up.workload import (
    Judge,
    WorkloadError,
    check_model_dir,
    load_workload,
)


def config(**sections) -> UpConfig:
    return UpConfig.model_validate(sections)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def verl_row(i: int, source: str = "gsm8k") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"Question {i}: what is {i} + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "ability": "math",
        "extra_info": {"index": i},
    }


def test_the_default_is_the_built_in_task_as_before() -> None:
    workload = load_workload(UpConfig())
    assert UpConfig().task_label == "arith" and workload.task is not None
    assert workload.train == TASKS["arith"].prompts("train", 4000, 0)
    assert workload.heldout == TASKS["arith"].prompts("heldout", 400, 0)
    assert max_tokens(UpConfig()) == 24
    assert UpConfig().warm_start_enabled


def test_a_dataset_is_the_task_and_its_held_out_rows_never_train(tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.jsonl", [verl_row(i) for i in range(200)])
    c = config(data={"train_files": [str(train)], "max_heldout": 5})
    workload = load_workload(c)
    assert c.task_label == "dataset" and workload.task is None
    assert not c.warm_start_enabled and max_tokens(c) == 256
    assert len(workload.heldout) == 5
    held = {json.dumps(r["messages"]) for r in workload.heldout}
    assert held.isdisjoint(json.dumps(r["messages"]) for r in workload.train)
    first = workload.train[0]
    number = int(first["messages"][0]["content"].split()[1].rstrip(":"))
    assert first["ground_truth"] == str(number + 1) and first["data_source"] == "gsm8k"
    assert workload.judge.correct("gsm8k", "so #### 8", "8")
    assert not workload.judge.correct("gsm8k", "so #### 9", "8")


def test_an_unknown_data_source_names_its_first_rows(tmp_path: Path) -> None:
    rows = [verl_row(0), verl_row(1, "mine"), verl_row(2, "mine")]
    train = write_rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(WorkloadError) as caught:
        load_workload(config(data={"train_files": [str(train)]}))
    message = str(caught.value)
    assert "data_source 'mine' has no scorer (2 rows, first:" in message
    assert f"{train} row 2" in message and "\n" not in message


def test_a_user_function_scores_its_data_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_reward.py").write_text(
        textwrap.dedent(
            """
            def exact(item):
                return 1.0 if item.response.strip() == item.ground_truth else 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [verl_row(i, "mine") for i in range(20)] + [verl_row(i, "gsm8k") for i in range(20)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    c = config(
        data={"train_files": [str(train)]},
        reward={"function": "my_reward:exact", "data_sources": ["mine"]},
    )
    judge = load_workload(c).judge
    assert judge.correct("mine", " 7 ", "7") and not judge.correct("mine", "8", "7")
    assert judge.correct("gsm8k", "#### 7", "7")  # still the rule scorer
    reward = up_reward_settings(c)
    assert reward["managers"]["user"] == {"type": "custom", "path": "my_reward:exact"}
    assert reward["tq_scorer"]["managers_by_data_source"] == {"mine": "user"}
    assert "naive" in reward["managers"]  # the rule scorers stay the default

    catch_all = config(reward={"function": "my_reward:exact"})
    assert Judge.for_run(catch_all).known_sources() is None
    assert up_reward_settings(catch_all)["tq_scorer"]["manager"] == "user"


def test_an_environments_reward_scores_every_other_data_source(tmp_path: Path) -> None:
    rows = [verl_row(i, "verifiers/my-env") for i in range(20)] + [verl_row(20, "mine")]
    train = write_rows(tmp_path / "train.jsonl", rows)
    agent = {"command": ["python", "agent.py"]}
    c = config(data={"train_files": [str(train)]}, reward={"env": True}, agent=agent)
    workload = load_workload(c)
    # only the environment can judge, so nothing is held out and every row trains
    assert len(workload.train) == 21 and workload.heldout == []
    assert all(record["agent"] == "external" for record in workload.train)
    reward = up_reward_settings(c)
    assert reward["managers"]["env"] == {"type": "env"}
    assert reward["tq_scorer"]["manager"] == "env" and "naive" in reward["managers"]

    held = write_rows(tmp_path / "held.jsonl", [verl_row(30, "verifiers/my-env")])
    given = config(
        data={"train_files": [str(train)], "heldout_files": [str(held)]},
        reward={"env": True}, agent=agent,
    )  # fmt: skip
    with pytest.raises(WorkloadError, match="held-out files were given, but this run evaluates"):
        load_workload(given)
    with pytest.raises(ValueError, match="only an agent reports its environment's reward"):
        config(reward={"env": True})
    with pytest.raises(ValueError, match="would both score every data_source"):
        config(reward={"env": True, "function": "m:f"}, agent=agent)


def test_a_reward_function_that_cannot_be_imported_is_one_line() -> None:
    with pytest.raises(WorkloadError, match=r"^reward.function: .*no_such_module") as caught:
        load_workload(config(reward={"function": "no_such_module:score"}))
    assert "\n" not in str(caught.value)


def test_a_reasoning_gym_task_splits_by_question_and_is_scored_by_its_checker() -> None:
    c = config(
        task={"name": "reasoning_gym:leg_counting", "train_prompts": 40, "heldout_prompts": 10}
    )
    workload = load_workload(c)
    assert c.task_label == "reasoning_gym:leg_counting" and not c.warm_start_enabled
    record = workload.train[0]
    assert [m["role"] for m in record["messages"]] == ["system", "user"]
    assert "<answer>" in record["messages"][0]["content"]
    assert record["data_source"] == "reasoning_gym:leg_counting"
    questions = {r["messages"][1]["content"] for r in workload.train}
    assert len(questions) == 40
    assert questions.isdisjoint(r["messages"][1]["content"] for r in workload.heldout)
    answer = json.loads(record["ground_truth"])["answer"]
    judge = workload.judge
    source, truth = record["data_source"], record["ground_truth"]
    assert judge.correct(source, f"Counting... <answer>{answer}</answer>", truth)
    assert not judge.correct(source, f"<answer>{int(answer) + 1}</answer>", truth)
    assert not judge.correct(source, f"the answer is {answer}", truth)  # no tag
    reward = up_reward_settings(c)
    assert reward["managers"]["reasoning_gym"] == {"type": "reasoning_gym"}
    assert reward["tq_scorer"]["managers_by_data_source"] == {
        "reasoning_gym:leg_counting": "reasoning_gym"
    }


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"name": "reasoning_gym:no_such_set"}, "reasoning-gym has no dataset 'no_such_set'"),
        (
            {"name": "reasoning_gym:leg_counting", "options": {"legs": 3}},
            "task.options for leg_counting:",
        ),
    ],
)
def test_reasoning_gym_mistakes_are_one_line(task: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message) as caught:
        load_workload(config(task=task))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"task": {"name": "chess"}}, "unknown task 'chess'"),
        ({"data": {"heldout_files": ["h.jsonl"]}}, "heldout_files needs train_files"),
        ({"reward": {"data_sources": ["mine"]}}, "data_sources needs a function"),
        ({"reward": {"function": "not a path"}}, "String should match pattern"),
        (
            {"task": {"name": "reasoning_gym:leg_counting"}, "warm_start": {"enabled": True}},
            "only the built-in tasks",
        ),
    ],
)
def test_config_mistakes_name_the_field(sections: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**sections)


def write_model_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "hidden_act": "silu",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(base | fields))
    return path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"attention_bias": True}, "llama attention_bias"),
    ],
)
def test_an_unsupported_model_is_refused_naming_the_key_and_value(
    tmp_path: Path, fields: dict, message: str
) -> None:
    path = write_model_config(tmp_path / "m", **fields)
    with pytest.raises(WorkloadError, match=message) as caught:
        check_model_dir(path)
    assert str(caught.value).startswith(str(path / "config.json"))


def test_a_model_folder_needs_a_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"config\.json does not exist"):
        check_model_dir(tmp_path)
    path = write_model_config(tmp_path / "m")
    with pytest.raises(WorkloadError, match=r"no \*\.safetensors weights"):
        check_model_dir(path)
    (path / "model.safetensors").write_bytes(b"")
    assert check_model_dir(path) == "llama"
