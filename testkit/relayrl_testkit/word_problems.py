"""A GSM8K-style dataset that the project generates: short word problems of four kinds, in
verl's RL layout (`data_source: openai/gsm8k`, the prompt as chat messages, the ground truth a
number), with the instruction verl's own GSM8K preprocessing appends. `make bench-learn-real`
trains SmolLM2-135M-Instruct on it, and the suite's own-model tests use a few rows.

    add        Mia has 7 marbles. She finds 5 more marbles. How many ...      one-digit sums
    add_tens   Omar has 23 cards. He buys 6 more cards. How many ...          two-digit + one
    take_away  Ben has 15 shells and gives 4 of them to a friend. How many ... differences
    groups     Lena has 3 boxes. Each box holds 4 cookies. How many ...       small products

The split is by question: the train and held-out rows never share a question (the same
numbers, names and objects), whatever their counts, and every run of the generator with one
seed writes the same rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = (
    ("Mia", "She"), ("Omar", "He"), ("Ben", "He"), ("Lena", "She"), ("Sam", "He"),
    ("Ava", "She"), ("Raj", "He"), ("Zoe", "She"), ("Tom", "He"), ("Ivy", "She"),
)  # fmt: skip
THINGS = ("marbles", "cards", "shells", "cookies", "stickers", "pencils", "books", "apples")

Question = tuple[str, int]  # (text, answer)


@dataclass(frozen=True)
class Kind:
    """One kind of problem: its wording, the ranges of its two numbers, how they combine."""

    text: str  # with {name}, {pronoun}, {thing}, {a}, {b}
    a: tuple[int, int]
    b: tuple[int, int]
    answer: Callable[[int, int], int]

    def draw(self, rng: random.Random) -> Question:
        (name, pronoun), thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(*self.a), rng.randint(*self.b)
        words = {"name": name, "pronoun": pronoun, "thing": thing, "a": a, "b": b}
        return self.text.format(**words), self.answer(a, b)


KINDS: dict[str, Kind] = {
    "add": Kind(
        "{name} has {a} {thing}. {pronoun} finds {b} more {thing}. "
        "How many {thing} does {name} have now?",
        (2, 9), (2, 9), lambda a, b: a + b,
    ),
    "add_tens": Kind(
        "{name} has {a} {thing}. {pronoun} buys {b} more {thing}. "
        "How many {thing} does {name} have now?",
        (10, 40), (2, 9), lambda a, b: a + b,
    ),
    "take_away": Kind(
        "{name} has {a} {thing} and gives {b} of them to a friend. "
        "How many {thing} does {name} have left?",
        (8, 19), (2, 7), lambda a, b: a - b,
    ),
    "groups": Kind(
        "{name} has {a} boxes. Each box holds {b} {thing}. "
        "How many {thing} are in the boxes altogether?",
        (2, 5), (2, 5), lambda a, b: a * b,
    ),
}  # fmt: skip


def row(kind: str, question: str, answer: int, split: str, index: int) -> dict:
    """One row in verl's layout."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "kind": kind},
    }


def _heldout(question: str, fraction: float) -> bool:
    """A stable split by question text (the same on every machine)."""
    import hashlib

    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def generate(
    num_train: int, num_heldout: int, seed: int = 0, heldout_fraction: float = 0.3
) -> tuple[list[dict], list[dict]]:
    """`num_train` and `num_heldout` distinct questions, the kinds in turn; ValueError when the
    question space runs out."""
    rng = random.Random(seed)
    kinds = list(KINDS.items())
    train: list[dict] = []
    heldout: list[dict] = []
    seen: set[str] = set()
    for attempt in range(50 * (num_train + num_heldout) + 1000):
        if len(train) == num_train and len(heldout) == num_heldout:
            return train, heldout
        kind, spec = kinds[attempt % len(kinds)]
        question, answer = spec.draw(rng)
        if question in seen:
            continue
        seen.add(question)
        if _heldout(question, heldout_fraction):
            if len(heldout) < num_heldout:
                heldout.append(row(kind, question, answer, "test", len(heldout)))
        elif len(train) < num_train:
            train.append(row(kind, question, answer, "train", len(train)))
    raise ValueError(f"could not draw {num_train} + {num_heldout} distinct questions")


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_dataset(
    directory: Path, num_train: int, num_heldout: int, seed: int = 0
) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl in `directory`."""
    train, heldout = generate(num_train, num_heldout, seed)
    return write(directory / "train.jsonl", train), write(directory / "test.jsonl", heldout)
