"""A user's own RL dataset: `.jsonl` or `.parquet` files in verl's layout or a flat one, read into
the trainer's prompt records (relayrl.trainer.feeder), with a held-out split that never trains.

Two row layouts are accepted:

    verl   {"data_source": str, "prompt": [{"role", "content"}, ...],
            "reward_model": {"ground_truth": str, ...}, "ability": str?, "extra_info": {...}?}
    flat   {"prompt": str | [{"role", "content"}, ...], "ground_truth": str,
            "data_source": str}

Every mistake is one line that names the file and row (1-based), so that a run refuses a bad
file before any service starts: a missing or unreadable file, an unknown format, a missing or
mistyped column, an empty prompt, a `data_source` no scorer knows.

Without held-out files, a row is held out when a stable hash (sha256) of its prompt lands
below `heldout_fraction`: the same prompt is on the same side on every machine and every run,
and duplicates of a held-out prompt are never trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXTRA_INFO_LABEL = "extra_info"
SUFFIXES = (".jsonl", ".parquet")
_ROLES = ("system", "user", "assistant", "tool")
Record = dict[str, Any]


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message is one line naming file and row."""


@dataclass(frozen=True)
class Dataset:
    """Prompt records (relayrl.trainer.feeder's format) of both splits."""

    train: list[Record]
    heldout: list[Record]
    sources: Mapping[str, int] = field(default_factory=dict)
    """Rows per data_source, both splits."""


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, raw row) of a .jsonl or .parquet file."""
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unknown format {path.suffix!r}; use {' or '.join(SUFFIXES)}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read it ({exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} row {number}: not JSON ({exc.msg})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types for every kind of bad file
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None
    yield from enumerate(table.to_pylist(), start=1)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: `prompt` is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: `prompt` must be a string or a non-empty list of messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DatasetError(f"{where}: prompt message {index} needs a string `content`")
        if message.get("role") not in _ROLES:
            raise DatasetError(
                f"{where}: prompt message {index} has role {message.get('role')!r}; "
                f"use one of {', '.join(_ROLES)}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: `prompt` is empty")
    return messages


def _ground_truth(row: Mapping[str, Any], where: str) -> str:
    if "reward_model" in row:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise DatasetError(f"{where}: `reward_model` must be an object with `ground_truth`")
        value = reward_model["ground_truth"]
    elif "ground_truth" in row:
        value = row["ground_truth"]
    else:
        raise DatasetError(f"{where}: no `reward_model.ground_truth` (verl) or `ground_truth`")
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    if value is None:
        raise DatasetError(f"{where}: the ground truth is null")
    return str(value)


def to_record(row: Any, where: str) -> Record:
    """One prompt record from a verl or flat row."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    if "prompt" not in row:
        raise DatasetError(f"{where}: no `prompt` column (columns: {', '.join(sorted(row))})")
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        raise DatasetError(f"{where}: `data_source` must be a non-empty string")
    record: Record = {
        "messages": _messages(row["prompt"], where),
        "ground_truth": _ground_truth(row, where),
        "data_source": source,
    }  # no agent: the trainer's data.agent, else the gateway's rollout.default_agent
    extra_info = row.get("extra_info")
    if extra_info is not None:
        if not isinstance(extra_info, dict):
            raise DatasetError(f"{where}: `extra_info` must be an object")
        # Labels are strings; an external agent gets the object back in its task.
        record["labels"] = {EXTRA_INFO_LABEL: json.dumps(extra_info, sort_keys=True, default=str)}
    return record


def prompt_key(record: Record) -> str:
    """The text the held-out split hashes: the prompt's messages, canonical JSON."""
    return json.dumps(record["messages"], sort_keys=True, ensure_ascii=False)


def is_heldout(record: Record, fraction: float) -> bool:
    digest = hashlib.sha256(prompt_key(record).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_records(paths: Sequence[Path]) -> tuple[list[Record], list[str]]:
    """The records of every file, and where each came from (`<file> row <n>`)."""
    records, places = [], []
    for path in paths:
        path = Path(path)
        before = len(records)
        for number, row in _rows(path):
            place = f"{path} row {number}"
            records.append(to_record(row, place))
            places.append(place)
        if len(records) == before:
            raise DatasetError(f"{path}: no rows")
    return records, places


def _check_sources(
    records: list[Record], places: list[str], known_sources: Collection[str]
) -> None:
    unknown: dict[str, list[str]] = {}
    for record, place in zip(records, places, strict=True):
        if record["data_source"] not in known_sources:
            unknown.setdefault(record["data_source"], []).append(place)
    if unknown:
        source, rows = next(iter(unknown.items()))
        more = f" and {len(unknown) - 1} more unknown" if len(unknown) > 1 else ""
        raise DatasetError(
            f"data_source {source!r} has no scorer ({len(rows)} rows, first: "
            f"{'; '.join(rows[:3])}){more}; known: {', '.join(sorted(known_sources))} "
            "(or your reward.function, or an agent's environment with reward.env)"
        )


def _check_ground_truths(
    records: list[Record], places: list[str], problem: Callable[[Record], str | None]
) -> None:
    bad = [(place, why) for record, place in zip(records, places, strict=True)
           if (why := problem(record)) is not None]  # fmt: skip
    if bad:
        place, why = bad[0]
        raise DatasetError(
            f"{place}: {why} ({len(bad)} of {len(records)} rows); fix the ground truths or "
            "score them with your own reward.function"
        )


def load_dataset(
    train_files: Sequence[Path],
    heldout_files: Sequence[Path] = (),
    *,
    heldout_fraction: float = 0.1,
    known_sources: Collection[str] | None = None,
    hold_out: bool = True,
    ground_truth_problem: Callable[[Record], str | None] | None = None,
) -> Dataset:
    """Both splits of a user's dataset. DatasetError (one line) for any mistake, including a
    data_source outside `known_sources` (when given), a row whose ground truth its scorer
    cannot read (`ground_truth_problem(record)` says why, or None) and a split left empty.
    Without `hold_out` (nothing can judge a held-out answer) every row trains."""
    if not train_files:
        raise DatasetError("no training files given")
    records, places = read_records(train_files)
    if not hold_out:
        if heldout_files:
            raise DatasetError("held-out files were given, but this run evaluates none")
        train, heldout = records, []
    elif heldout_files:
        heldout, heldout_places = read_records(heldout_files)
        places += heldout_places
        held = {prompt_key(r) for r in heldout}
        train = [r for r in records if prompt_key(r) not in held]  # never train on held-out
    else:
        if not 0.0 < heldout_fraction < 1.0:
            raise DatasetError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        heldout = [r for r in records if is_heldout(r, heldout_fraction)]
        train = [r for r in records if not is_heldout(r, heldout_fraction)]
    everything = records + (heldout if heldout_files else [])
    if known_sources is not None:
        _check_sources(everything, places, known_sources)
    if ground_truth_problem is not None:
        _check_ground_truths(everything, places, ground_truth_problem)
    for name, split in (("training", train), ("held-out", heldout)):
        if not split and (hold_out or name == "training"):
            raise DatasetError(f"the {name} split is empty; give more rows or another split")
    sources: dict[str, int] = {}
    for record in train + heldout:
        sources[record["data_source"]] = sources.get(record["data_source"], 0) + 1
    return Dataset(train=train, heldout=heldout, sources=sources)
