"""The trainer's prompt feeder: prompt groups into the TransferQueue, ahead of training.

The feeder owns one number, `num_issued`: the n-th issued group has uid `<run_id>-<n>`, and its
prompt is the curriculum's choice (relayrl.trainer.curriculum: re-issues of prompts whose group
could not be trained for a reason outside the policy, every prompt once per epoch, replays of
prompts that still have signal). A group carries its prompt's row as `prompt_key`, so the
trainer's verdict on it teaches the curriculum about that prompt, and a re-issue names the group
it re-issues (`retry_of`) and how many re-issues it is (`retry`).

A uid, once put, names one prompt forever: the TransferQueue keeps the first put of a key. The
cursor and the curriculum's state are checkpointed; on resume the feeder adopts the groups
already in the queue past the checkpoint's cursor (issued after it, before the crash) instead
of issuing those uids again, and the curriculum counts their prompts as issued
(docs/recovery.md#prompts-across-a-restart).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.model import GroupStatus
from relayrl.trainer.curriculum import Curriculum, Issue, RetryCause, Skipped

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
        curriculum: Curriculum,
        num_issued: int = 0,
    ) -> None:
        self._tq = tq
        self._records = records
        self._template = template
        self.curriculum = curriculum
        self.num_issued = num_issued
        # prompts chosen for uids not yet put: a put retried after an outage reuses them
        self._chosen: dict[int, Issue] = {}

    def uid(self, n: int) -> str:
        return f"{self._template.run_id}-{n:09d}"

    def group(self, n: int, issue: Issue, step: int) -> common_pb2.PromptGroup:
        """The n-th group, of `issue`."""
        index = issue.index
        record = self._records[index]
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
            prompt_key=str(index),
            retry_of=issue.retry_of,
            retry=issue.retry,
        )

    def adopt_existing(self) -> int:
        """After a resume: moves the cursor past groups that are already in the queue, and the
        curriculum counts their prompts as issued."""
        adopted = 0
        partition = self._template.partition
        while self._tq.groups_exist(partition, [self.uid(self.num_issued)])[0]:
            (found,) = self._tq.get_groups(
                partition, [self.uid(self.num_issued)], with_trajectories=False
            )
            group = found.group
            index = self.prompt_index(group)
            if index is not None:
                self.curriculum.adopt(group.uid, Issue(index, group.retry_of, group.retry))
            self.num_issued += 1
            adopted += 1
        return adopted

    def dropped_in_flight(self) -> list[common_pb2.PromptGroup]:
        """After a resume: groups the curriculum has in flight that the queue holds as dropped.
        The staleness gate drops a group before it tells the feeder, so these were evicted
        after the checkpoint by a trainer that died before its state was saved again: the
        caller re-issues them (`retry`)."""
        uids = self.curriculum.in_flight_groups()
        if not uids:
            return []
        partition = self._template.partition
        exists = self._tq.groups_exist(partition, uids)
        present = [u for u, found in zip(uids, exists, strict=True) if found]
        if not present:
            return []
        groups = self._tq.get_groups(partition, present, with_trajectories=False)
        dropped = GroupStatus.DROPPED.to_proto()
        return [g.group for g in groups if g.group.tags.status == dropped]

    def prompt_index(self, group: common_pb2.PromptGroup) -> int | None:
        """The row of this feeder's prompts that `group` rolls out, if it is one of ours."""
        key = group.prompt_key
        if not key.isdigit() or int(key) >= len(self._records):
            return None
        return int(key)

    def issue_up_to(self, target: int, step: int) -> int:
        """Issues groups until `target` have been issued in all; returns how many now."""
        count = max(0, target - self.num_issued)
        if count:
            for n in range(self.num_issued, target):
                if n not in self._chosen:
                    self._chosen[n] = self.curriculum.next_issue(step, self.uid(n))
            groups = [self.group(n, self._chosen[n], step) for n in range(self.num_issued, target)]
            self._tq.put_groups(self._template.partition, groups)
            self._chosen.clear()
            self.num_issued = target
        return count

    def observe(self, group: common_pb2.PromptGroup, step: int, valid_rewards: list[float]) -> None:
        """The trainer judged a group at `step` for the policy (kept, or without signal): the
        curriculum learns about its prompt."""
        if self.prompt_index(group) is not None:
            self.curriculum.observe(group.uid, step, valid_rewards)

    def retry(
        self, group: common_pb2.PromptGroup, cause: RetryCause, reason: str
    ) -> Skipped | None:
        """The trainer cannot train `group` for a reason outside the policy: its prompt is
        re-issued by the next issue, or skipped once the issue's budget is spent (returned)."""
        if self.prompt_index(group) is None:
            return None
        return self.curriculum.retry(group.uid, cause, reason)

    def reissued(self, group: common_pb2.PromptGroup) -> bool:
        """Whether `group`'s prompt was re-issued before a restart (`Curriculum.reissued`)."""
        return self.prompt_index(group) is not None and self.curriculum.reissued(group.uid)

    def state_dict(self) -> dict[str, Any]:
        return {"num_issued": self.num_issued, "curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_issued = int(state["num_issued"])
        self._chosen.clear()
        self.curriculum.load_state_dict(state["curriculum"])
