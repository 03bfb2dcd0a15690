"""A user's dataset files (relayrl.tasks.datasets): verl and flat rows become prompt records,
the held-out split is stable and never trained on, and every mistake is one line naming the
file and row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relayrl.tasks.datasets import DatasetError, is_heldout, load_dataset

VERL_ROW = {
    "data_source": "arith",
    "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {"split": "train", "index": 0},
}


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def questions(n: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"What is {i} + 1?", "ground_truth": str(i + 1), "data_source": "arith"}
        for i in range(n)
    ]


def test_verl_and_flat_rows_become_the_same_kind_of_record(tmp_path: Path) -> None:
    flat = {"prompt": "What is 4 + 4?", "ground_truth": 8, "data_source": "arith"}
    train = jsonl(tmp_path / "train.jsonl", [VERL_ROW, flat])
    heldout = jsonl(tmp_path / "heldout.jsonl", questions(1))
    data = load_dataset([train], [heldout], known_sources={"arith"})
    assert data.train == [
        {
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "ground_truth": "5",
            "data_source": "arith",
            # kept for an external agent's task (strings only on a group's labels)
            "labels": {"extra_info": '{"index": 0, "split": "train"}'},
        },
        {
            "messages": [{"role": "user", "content": "What is 4 + 4?"}],
            "ground_truth": "8",
            "data_source": "arith",
        },
    ]
    assert data.sources == {"arith": 3}


def test_the_split_is_stable_disjoint_and_keeps_duplicates_together(tmp_path: Path) -> None:
    rows = questions(400)
    rows += rows[:50]  # duplicated prompts
    path = jsonl(tmp_path / "train.jsonl", rows)
    first = load_dataset([path], heldout_fraction=0.2)
    again = load_dataset([path], heldout_fraction=0.2)
    assert first == again
    train_prompts = {json.dumps(r["messages"]) for r in first.train}
    heldout_prompts = {json.dumps(r["messages"]) for r in first.heldout}
    assert not train_prompts & heldout_prompts
    assert len(first.train) + len(first.heldout) == 450
    assert 0.12 < len(heldout_prompts) / 400 < 0.28
    assert all(is_heldout(r, 0.2) for r in first.heldout)


def test_rows_in_the_heldout_files_are_never_trained_on(tmp_path: Path) -> None:
    rows = questions(10)
    data = load_dataset(
        [jsonl(tmp_path / "train.jsonl", rows)], [jsonl(tmp_path / "held.jsonl", rows[:3])]
    )
    assert len(data.train) == 7 and len(data.heldout) == 3
    assert not {json.dumps(r["messages"]) for r in data.train} & {
        json.dumps(r["messages"]) for r in data.heldout
    }


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "", "ground_truth": "1", "data_source": "arith"}], "row 1: `prompt` is empty"),
        ([{"ground_truth": "1", "data_source": "arith"}], "row 1: no `prompt` column"),
        ([{"prompt": "q", "data_source": "arith"}], "row 1: no `reward_model.ground_truth`"),
        ([{"prompt": "q", "ground_truth": "1"}], "row 1: `data_source` must be"),
        ([{**VERL_ROW, "reward_model": {"style": "rule"}}], "`reward_model` must be an object"),
        ([{**VERL_ROW, "prompt": [{"role": "robot", "content": "x"}]}], "role 'robot'"),
        ([{**VERL_ROW, "prompt": [{"role": "user", "content": "  "}]}], "`prompt` is empty"),
        ([VERL_ROW, "not an object"], "row 2: expected an object"),
        ([], "no rows"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_row(
    tmp_path: Path, rows: list[Any], message: str
) -> None:
    path = jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DatasetError) as error:
        load_dataset([path], heldout_fraction=0.5)
    text = str(error.value)
    assert message in text and str(path) in text and "\n" not in text, text


def test_file_mistakes_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset([tmp_path / "absent.jsonl"])
    with pytest.raises(DatasetError, match=r"unknown format '\.csv'"):
        load_dataset([tmp_path / "data.csv"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(VERL_ROW) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"broken\.jsonl row 2: not JSON"):
        load_dataset([broken])


def test_an_unknown_data_source_names_its_first_rows(tmp_path: Path) -> None:
    rows = questions(3) + [{**VERL_ROW, "data_source": "gsm8k"}] * 4
    path = jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DatasetError) as error:
        load_dataset([path], known_sources={"arith", "lookup"})
    text = str(error.value)
    assert "data_source 'gsm8k' has no scorer (4 rows, first:" in text, text
    assert f"{path} row 4; {path} row 5; {path} row 6)" in text, text
    assert "known: arith, lookup" in text


def test_an_empty_split_is_refused(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "train.jsonl", questions(1))
    with pytest.raises(DatasetError, match="split is empty"):
        load_dataset([path], heldout_fraction=0.01)


def test_the_trainer_feeds_exactly_the_training_split(tmp_path: Path) -> None:
    """A trainer given the dataset (as the chart configures it) feeds the rows `relayrl up`
    trains on and none it holds out."""
    from relayrl.trainer.config import PromptDataConfig
    from relayrl.trainer.feeder import PromptFileError, load_dataset_prompts

    rows = [
        {"prompt": f"question {i}", "ground_truth": str(i), "data_source": "gsm8k"}
        for i in range(100)
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = load_dataset([path], heldout_fraction=0.2)
    fed = load_dataset_prompts([path], [], 0.2)
    assert [r.messages for r in fed] == [
        tuple((m["role"], m["content"]) for m in record["messages"]) for record in dataset.train
    ]
    assert {r.ground_truth for r in fed}.isdisjoint(r["ground_truth"] for r in dataset.heldout)
    with pytest.raises(PromptFileError, match=r"missing\.jsonl: no such file"):
        load_dataset_prompts([tmp_path / "missing.jsonl"], [], 0.2)
    with pytest.raises(ValueError, match="prompts_file or train_files, not both"):
        PromptDataConfig(prompts_file=path, train_files=[path])
    with pytest.raises(ValueError, match="heldout_files needs train_files"):
        PromptDataConfig(heldout_files=[path])
