"""The trainer's prompt feeder: prompt groups into the TransferQueue, ahead of training.

The feeder owns one number, `num_issued`: prompts are issued in a fixed, seeded order (a fresh
permutation per epoch), and the n-th issued group always has uid `<run_id>-<n>` and the same
prompt, so feeding is idempotent. The cursor is checkpointed; on resume the feeder also skips
uids already in the queue (issued after the checkpoint, before the crash), because re-putting
one with a newer prompt_step would be a different group under the same uid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue

_ALLOWED_KEYS = {"prompt", "messages", "ground_truth", "data_source", "agent", "labels"}


@dataclass(frozen=True)
class PromptRecord:
    messages: tuple[tuple[str, str], ...]  # (role, content)
    ground_truth: str
    data_source: str
    agent: str
    labels: tuple[tuple[str, str], ...]


class PromptFileError(ValueError):
    """A prompts file that cannot be used; the message names the file and line."""


def _record(raw: object, where: str) -> PromptRecord:
    if not isinstance(raw, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - _ALLOWED_KEYS
    if unknown:
        raise PromptFileError(
            f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_ALLOWED_KEYS)})"
        )
    if ("prompt" in raw) == ("messages" in raw):
        raise PromptFileError(f"{where}: give exactly one of `prompt` (text) or `messages`")
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str) or not raw["prompt"]:
            raise PromptFileError(f"{where}: `prompt` must be a non-empty string")
        messages = (("user", raw["prompt"]),)
    else:
        items = raw["messages"]
        if not isinstance(items, list) or not items:
            raise PromptFileError(f"{where}: `messages` must be a non-empty list")
        try:
            messages = tuple((str(m["role"]), str(m["content"])) for m in items)
        except (TypeError, KeyError):
            raise PromptFileError(f"{where}: every message needs `role` and `content`") from None
    labels = raw.get("labels", {})
    if not isinstance(labels, dict):
        raise PromptFileError(f"{where}: `labels` must be an object of strings")
    return PromptRecord(
        messages=messages,
        ground_truth=str(raw.get("ground_truth", "")),
        data_source=str(raw.get("data_source", "")),
        agent=str(raw.get("agent", "")),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
    )


def load_prompts(path: Path) -> list[PromptRecord]:
    """Reads a JSONL prompts file; every mistake names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PromptFileError(f"{path}: cannot read prompts file ({exc.strerror})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not JSON ({exc.msg})") from None
        records.append(_record(raw, f"{path}:{number}"))
    if not records:
        raise PromptFileError(f"{path}: no prompts")
    return records


def load_dataset_prompts(
    train_files: list[Path], heldout_files: list[Path], heldout_fraction: float
) -> list[PromptRecord]:
    """The training split of a user's dataset (relayrl.tasks.datasets: verl or flat rows,
    .jsonl or .parquet), held-out prompts removed as `relayrl up` removes them."""
    from relayrl.tasks.datasets import DatasetError, load_dataset

    try:
        dataset = load_dataset(train_files, heldout_files, heldout_fraction=heldout_fraction)
    except DatasetError as exc:
        raise PromptFileError(str(exc)) from None
    return [_record(raw, f"{raw['data_source']} prompt") for raw in dataset.train]


class PromptOrder:
    """The n-th prompt to issue: epoch n // N, position from that epoch's seeded permutation."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        self._num_prompts = num_prompts
        self._seed = seed
        self._epoch = -1
        self._permutation = np.arange(num_prompts)

    def index(self, n: int) -> int:
        epoch, position = divmod(n, self._num_prompts)
        if epoch != self._epoch:
            self._permutation = np.random.default_rng([self._seed, epoch]).permutation(
                self._num_prompts
            )
            self._epoch = epoch
        return int(self._permutation[position])


@dataclass(frozen=True)
class GroupTemplate:
    """What every issued group shares."""

    partition: str
    run_id: str
    samples_per_prompt: int
    max_tokens: int
    temperature: float
    default_agent: str


class PromptFeeder:
    def __init__(
        self,
        tq: TransferQueue,
        records: list[PromptRecord],
        template: GroupTemplate,
        seed: int,
        num_issued: int = 0,
    ) -> None:
        self._tq = tq
        self._records = records
        self._template = template
        self._order = PromptOrder(len(records), seed)
        self.num_issued = num_issued

    def uid(self, n: int) -> str:
        return f"{self._template.run_id}-{n:09d}"

    def group(self, n: int, step: int) -> common_pb2.PromptGroup:
        record = self._records[self._order.index(n)]
        t = self._template
        return common_pb2.PromptGroup(
            uid=self.uid(n),
            partition=t.partition,
            prompt_step=step,
            num_samples=t.samples_per_prompt,
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in record.messages],
            data_source=record.data_source,
            ground_truth=record.ground_truth,
            sampling=common_pb2.SamplingParams(
                temperature=t.temperature, max_response_tokens=t.max_tokens
            ),
            agent=record.agent or t.default_agent,
            labels=dict(record.labels),
        )

    def skip_existing(self) -> int:
        """After a resume: moves the cursor past groups that are already in the queue."""
        skipped = 0
        while self._tq.groups_exist(self._template.partition, [self.uid(self.num_issued)])[0]:
            self.num_issued += 1
            skipped += 1
        return skipped

    def issue_up_to(self, target: int, step: int) -> int:
        """Issues groups until `target` have been issued in all; returns how many now."""
        count = max(0, target - self.num_issued)
        if count:
            groups = [self.group(n, step) for n in range(self.num_issued, target)]
            self._tq.put_groups(self._template.partition, groups)
            self.num_issued = target
        return count
