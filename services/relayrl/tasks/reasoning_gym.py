"""`reasoning_gym:<dataset>`: a procedural task of the reasoning-gym package as prompt records.

Each item becomes a single-turn prompt (reasoning-gym's default system prompt, which asks for
the answer inside `<answer>...</answer>`, then the question). The ground truth is the item's
answer and metadata as JSON: reasoning-gym's checkers need both, and the reward-service's
`reasoning_gym` manager (relayrl.reward.managers.reasoning_gym) reads them back. data_source is
`reasoning_gym:<dataset>`.

Splits as for the built-in tasks: a question is held out when the sha256 of its text lands
below `heldout_fraction`, so no seed or count puts a held-out question into training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relayrl.tasks.base import SPLITS, Split, split_of

DATA_SOURCE_PREFIX = "reasoning_gym:"
HELDOUT_FRACTION = 0.2
# Items drawn per requested prompt before a split counts as exhausted.
MAX_DRAWS_PER_PROMPT = 50

Record = dict[str, Any]


def dataset_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def ground_truth(entry: Mapping[str, Any]) -> str:
    """What the checker needs of an item, as the prompt record's ground truth."""
    return json.dumps(
        {"answer": entry["answer"], "metadata": entry.get("metadata", {})},
        sort_keys=True,
        default=str,
    )


@dataclass(frozen=True)
class ReasoningGymTask:
    dataset: str
    options: Mapping[str, Any] = field(default_factory=dict)
    heldout_fraction: float = HELDOUT_FRACTION

    @property
    def data_source(self) -> str:
        return f"{DATA_SOURCE_PREFIX}{self.dataset}"

    @classmethod
    def create(cls, dataset: str, options: Mapping[str, Any]) -> ReasoningGymTask:
        """ValueError (one line) for an unknown dataset or a config field it refuses."""
        names = dataset_names()
        if dataset not in names:
            close = [n for n in names if dataset[:3] in n][:8]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise ValueError(
                f"reasoning-gym has no dataset {dataset!r}{hint}; {len(names)} exist, e.g. "
                "leg_counting, basic_arithmetic, chain_sum"
            )
        task = cls(dataset, dict(options))
        task._generator(size=1, seed=0)  # the dataset's own config checks, now
        return task

    def _generator(self, size: int, seed: int):
        import reasoning_gym

        try:
            return reasoning_gym.create_dataset(self.dataset, size=size, seed=seed, **self.options)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"task.options for {self.dataset}: {exc}") from None

    def prompt_record(self, entry: Mapping[str, Any]) -> Record:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return {
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPTS["default"]},
                {"role": "user", "content": entry["question"]},
            ],
            "ground_truth": ground_truth(entry),
            "data_source": self.data_source,
            "agent": "single_turn",
        }

    def prompts(self, split: Split, n: int, seed: int) -> list[Record]:
        """`n` distinct prompt records of `split`, the same for the same arguments."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        draws = MAX_DRAWS_PER_PROMPT * max(n, 1)
        generator = self._generator(size=draws, seed=seed)
        records: list[Record] = []
        seen: set[str] = set()
        for index in range(draws):
            if len(records) == n:
                break
            entry = generator[index]
            question = entry["question"]
            if question in seen or split_of(question, self.heldout_fraction) != split:
                continue
            seen.add(question)
            records.append(self.prompt_record(entry))
        if len(records) < n:
            raise ValueError(
                f"found only {len(records)} distinct {split} questions of the {n} asked; ask "
                "for fewer or widen the dataset's options"
            )
        return records
