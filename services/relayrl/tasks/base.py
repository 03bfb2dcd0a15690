"""What every built-in task shares: the `Task` contract, the train/held-out split, JSONL
writing, and held-out scoring with the reward-service's own rule scorer.

The split is decided by the question, not by the seed or by position: each question names one
or more canonical forms (`Question.split_keys`, e.g. `"7 + 12"` for both `12 + 7` and
`7 + 12`), each form is hashed to a point in [0, 1), and a question belongs to `heldout` only
if every form lands below `heldout_fraction`, to `train` only if every form lands above it
(others are skipped). So no seed, count or knob can put a held-out question into training.
"""

from __future__ import annotations

import abc
import hashlib
import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from relayrl.core.atomic import atomic_open
from relayrl.reward.items import RewardItem, Status
from relayrl.reward.managers.rules import RULE_SCORERS

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = get_args(Split)
ANSWER_INSTRUCTION = "End your reply with: Answer: <integer>"
"""The last line of every prompt: the format `score_arith` accepts."""

# Draws allowed per requested question before `prompts` says the split has run out of distinct
# questions (the rarest acceptance is about heldout_fraction ** len(split_keys)).
MAX_DRAWS_PER_QUESTION = 200

Record = dict[str, Any]


@dataclass(frozen=True)
class Question:
    """One drawn question: the user's text, the integer the rule checks, the canonical forms
    that decide its split, and the group labels its tools read (in the order the text names
    them)."""

    text: str
    answer: int
    split_keys: tuple[str, ...]
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def identity(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Two draws with the same identity are the same question (deduplicated)."""
        return self.text, tuple(sorted(self.labels.items()))


def split_of(canonical: str, heldout_fraction: float) -> Split:
    """The split one canonical form hashes to (sha256, so it is the same on every machine and
    Python run, unlike `hash()`)."""
    digest = hashlib.sha256(canonical.encode("utf-8")).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64
    return "heldout" if position < heldout_fraction else "train"


@dataclass(frozen=True)
class Task(abc.ABC):
    """A built-in task: draws questions, writes the trainer's prompt records and the warm
    start's SFT examples. Subclasses are frozen dataclasses whose fields are difficulty knobs.

    Records follow `relayrl.trainer.feeder` (`prompt`, `ground_truth`, `data_source`,
    `agent`, `labels`) and `relayrl.trainer.sft` (`prompt` or `messages`, `answer`)."""

    name: ClassVar[str]
    agent: ClassVar[str]
    """The gateway's agent loop for this task's groups."""
    data_source: ClassVar[str] = "arith"
    """The reward-service's rule scorer (a key of `RULE_SCORERS`)."""

    heldout_fraction: float = 0.2
    """Share of canonical question forms reserved for held-out evaluation."""

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        assert self.data_source in RULE_SCORERS, self.data_source

    @abc.abstractmethod
    def draw(self, rng: random.Random) -> Question:
        """One random question (of either split)."""

    @abc.abstractmethod
    def sft_turns(self, question: Question) -> list[Record]:
        """The SFT examples that teach the rewarded reply to `question`: one per assistant
        turn, each `{"prompt" | "messages", "answer"}`."""

    def questions(
        self, split: Split, n: int, seed: int, *, stream: str = "prompts"
    ) -> list[Question]:
        """`n` distinct questions of `split`, the same for the same arguments; a longer list
        with the same seed starts with the shorter one. ValueError when the split does not hold
        `n` distinct questions (raise a difficulty knob)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        # A string seed is hashed with sha512 by `random`: stable across runs and machines.
        rng = random.Random(f"{self.name}:{stream}:{split}:{seed}")
        chosen: list[Question] = []
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for _ in range(MAX_DRAWS_PER_QUESTION * n):
            if len(chosen) == n:
                break
            question = self.draw(rng)
            if question.identity in seen or any(
                split_of(key, self.heldout_fraction) != split for key in question.split_keys
            ):
                continue
            seen.add(question.identity)
            chosen.append(question)
        if len(chosen) < n:
            raise ValueError(
                f"task {self.name}: found only {len(chosen)} distinct {split} questions of the "
                f"{n} asked; ask for fewer or make the task larger (more digits, keys, values)"
            )
        return chosen

    def prompt_record(self, question: Question) -> Record:
        """One line of the trainer's prompts file."""
        record: Record = {
            "prompt": question.text,
            "ground_truth": str(question.answer),
            "data_source": self.data_source,
            "agent": self.agent,
        }
        if question.labels:
            record["labels"] = dict(question.labels)
        return record

    def prompts(self, split: Split, n: int, seed: int) -> list[Record]:
        """`n` prompt records of `split` (see `questions`)."""
        return [self.prompt_record(q) for q in self.questions(split, n, seed)]

    def sft_examples(self, n: int, seed: int) -> list[Record]:
        """Warm-start examples for `n` train questions (never held-out ones), every answer
        one the reward rule scores correct. Drawn from their own random stream, so they are
        not simply the first GRPO prompts."""
        return [
            example
            for question in self.questions("train", n, seed, stream="sft")
            for example in self.sft_turns(question)
        ]


def write_jsonl(records: Iterable[Mapping[str, Any]], path: Path) -> int:
    """Writes one JSON object per line (UTF-8), atomically: a crash leaves the old file or the
    new one, never half of it. Returns the number of records."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with atomic_open(path, "w") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def score(task: Task, response: str, ground_truth: str) -> bool:
    """Whether `response` earns the reward for a question of `task`: the reward-service's rule
    scorer for the task's data_source decides (the same function, not a copy), so held-out
    accuracy and training reward cannot disagree. For a tool_agent task, `response` is the
    whole decoded response (tool calls and observations included), as the gateway sends it."""
    item = RewardItem(
        item_id=f"{task.name}-eval",
        data_source=task.data_source,
        response=response,
        ground_truth=ground_truth,
    )
    return RULE_SCORERS[task.data_source](item).status is Status.OK
