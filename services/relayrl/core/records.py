"""The records a run writes as JSONL, and the one way to write and read them.

    trainer/steps.jsonl         StepRecord      relayrl.trainer.metrics, one per trainer step
    eval.jsonl                  EvalRecord      relayrl.up.run, one per held-out evaluation
    weightsync/transfers.jsonl  TransferRecord  relayrl.weightsync.versions, one per transfer

Each is defined here, at the bottom of the package layers (docs/architecture.md#package-layers),
once for its writer (the trainer, weight-sync, `relayrl up`) and its readers (`relayrl up`'s
report, audit, status and progress, the test kit, the benches): every one of them may import
`relayrl.core`, and it imports none of them. A reader gets typed records: a field is there with its
type, or the line is not a record at all (see `read_records`), so no reader checks a value's
type again.

A line is `json.dumps(record, sort_keys=True)` of the record's fields (`Record.to_line`), with
the key set each writer always had: the step record leaves out a scalar the step did not
measure, the other two write every field (null included).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import IO, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

R = TypeVar("R", bound="Record")


class Record(BaseModel):
    """One line of a run's JSONL file. A misspelt key, a wrong type or a non-finite number is
    not a record."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    OMIT_NONE: ClassVar[bool] = False
    """Whether a field that is None is left out of the line (instead of written as null)."""

    def to_line(self) -> str:
        """The record as one JSON line, without its newline."""
        return json.dumps(self.model_dump(mode="json", exclude_none=self.OMIT_NONE), sort_keys=True)


class RecordError(ValueError):
    """A line of a record file that is not a record; the message starts with `path:line:`."""


# -- the records --------------------------------------------------------------------------------


class SetAside(Record):
    """A prompt the curriculum's epoch walk skipped at a step, and why."""

    prompt: int  # its index in the training set
    epoch: int
    epochs: int  # how many epochs it stays aside
    reason: str


class Skipped(Record):
    """An issue of a prompt that ended untrained at a step: its retry budget ran out
    (docs/algorithms.md#retries)."""

    prompt: int  # its index in the training set
    uid: str  # the last group
    retries: int  # re-issues spent
    cause: Literal["no_valid", "one_valid", "stale"]
    reason: str


class StepRecord(Record):
    """One trainer step (`trainer/steps.jsonl`). A step re-run after a trainer restart is logged
    again; its last record is the one that counts.

    Per-step scalars are floats and absent when the step did not measure them (None here): a
    bypass step has no mismatch metrics, a run without a reference model no ref_kl, and a value
    that is not finite (a NaN loss) is left out by the trainer, so it reads as absent too. The
    named ones are those the trainer may write under a fixed name; scalars named at run time
    (a rejection rule's `rs_rule{i}_{label}_*`, the publisher's `publish_{phase}_s`) are extra
    fields, floats as well."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, float] = Field(init=False)  # type: ignore[assignment]

    OMIT_NONE: ClassVar[bool] = True

    step: int  # 0-based: the record of step k is the (k+1)-th update
    time: float  # unix seconds when it was logged
    phases_s: dict[str, float] = {}  # wait, old_logprobs, update, model, publish, ...
    groups: dict[str, int] = {}  # consumed groups by verdict: keep, stale, no_signal, evicted...
    no_signal: dict[str, int] = {}  # groups without signal, by reason
    failures: dict[str, int] = {}  # rollouts failed as infrastructure, by reason
    generated_tokens: dict[str, int] = {}  # response tokens of the consumed groups, by verdict
    staleness_histogram: dict[int, int] = {}  # trained groups by staleness
    policy_lag_histogram: dict[int, int] = {}  # trained groups by step - launching version
    set_aside: list[SetAside] = []
    retried: dict[str, int] = {}  # groups whose prompt was re-issued, by cause
    skipped: list[Skipped] = []  # issues of a prompt given up after their retry budget
    uids: list[str] = []  # the groups trained at this step
    row_tokens: list[int] = []  # prompt + response tokens of each trained row, in order

    # what was consumed (relayrl.trainer.loop)
    reward_mean: float | None = None
    reward_std: float | None = None
    staleness_mean: float | None = None
    staleness_max: float | None = None
    policy_lag_mean: float | None = None
    policy_lag_max: float | None = None
    rollouts: float | None = None
    failed_rollouts: float | None = None
    filter_budget_spent: float | None = None
    epoch: float | None = None
    trained_response_len_mean: float | None = None
    launched_response_len_mean: float | None = None
    step_duration_s: float | None = None
    wait_duration_s: float | None = None
    tokens_per_s: float | None = None
    # the update (relayrl.trainer.step)
    trained_tokens: float | None = None
    response_tokens: float | None = None
    num_updates: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    update_skipped: float | None = None
    lr: float | None = None
    pg_clipfrac: float | None = None
    pg_approx_kl: float | None = None
    ref_kl: float | None = None
    # importance weights and rejection (relayrl.trainer.losses)
    is_mean: float | None = None
    is_max: float | None = None
    is_ess: float | None = None
    is_raw_ess: float | None = None
    is_frac_capped: float | None = None
    is_raw_frac_over_cap: float | None = None
    is_frac_zeroed: float | None = None
    is_frac_clamped: float | None = None
    rs_rejected_token_frac: float | None = None
    rs_rejected_seq_frac: float | None = None
    # train/inference mismatch (relayrl.trainer.losses.mismatch_metrics)
    kl: float | None = None
    k3_kl: float | None = None
    log_ppl_diff: float | None = None
    ppl_ratio: float | None = None
    chi2_token: float | None = None
    chi2_seq: float | None = None
    abs_log_ratio_mean: float | None = None
    abs_log_ratio_p99: float | None = None
    abs_log_ratio_max: float | None = None
    # the publisher (relayrl.trainer.publish)
    publish_bytes: float | None = None
    publish_sent_bytes: float | None = None
    # the benchmark stand-in of the update (relayrl.trainer.step.EmulatedUpdater)
    emulated_update: float | None = None
    trained_rows: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _leave_out_non_finite(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {
                k: v for k, v in data.items() if not (isinstance(v, float) and not math.isfinite(v))
            }
        return data


class EvalRecord(Record):
    """One held-out evaluation (`eval.jsonl`); a failed one says so (`failed`, `error`) and has
    no accuracy."""

    kind: Literal["warm_start", "first_update", "periodic", "final"]
    step: int  # trainer steps completed when it started
    version: int  # the first weight version that served its tokens (-1: tokens no version served)
    version_end: int  # ... and the last
    n: int
    correct: int
    accuracy: float | None  # greedy; None when the evaluation failed
    sampled_accuracy: float | None  # at the training temperature, when asked for
    seconds: float
    time: float  # unix seconds when it ended
    tokens: int = 0  # generated by the greedy pass
    failed: bool = False
    error: str = ""

    @model_validator(mode="after")
    def _accuracy_unless_failed(self) -> EvalRecord:
        if (self.accuracy is None) != self.failed:
            raise ValueError("an evaluation has an accuracy exactly when it did not fail")
        return self

    @classmethod
    def failure(cls, kind: str, step: int, error: str, seconds: float) -> EvalRecord:
        return cls.model_validate(
            {
                "kind": kind, "step": step, "version": -1, "version_end": -1, "n": 0,
                "correct": 0, "accuracy": None, "sampled_accuracy": None,
                "seconds": round(seconds, 3), "time": time.time(), "failed": True, "error": error,
            }
        )  # fmt: skip


class TransferRecord(Record):
    """One finished weight-sync transfer (`weightsync/transfers.jsonl`)."""

    version: int
    trainer_step: int
    state: Literal["committed", "failed"]
    transport: str
    bytes: int
    replicas: list[str]
    durations_s: dict[str, float]  # boundary (export, transport, pause_window, ...) -> seconds
    error: str
    time: float  # unix seconds when it finished


# -- writing ------------------------------------------------------------------------------------


def _mend_torn_tail(path: Path) -> None:
    """Before appending to `path`: a last line without its newline (its writer was killed in
    the middle of it) would run into the next record. If it is a whole JSON value (the kill fell
    just before the newline) it gets its newline; otherwise it is cut off (logged)."""
    try:
        f = path.open("r+b")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start, tail = _last_line(f, size)
        try:
            json.loads(tail)
        except (UnicodeDecodeError, json.JSONDecodeError):
            f.truncate(start)
            logger.warning("%s: cut off a torn last line (%d bytes)", path, size - start)
        else:
            f.seek(size)
            f.write(b"\n")


def _last_line(f: IO[bytes], size: int, chunk: int = 1 << 16) -> tuple[int, bytes]:
    """(offset, bytes) of the text after the last newline of a file of `size` bytes."""
    tail = b""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        block = f.read(end - start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1, block[newline + 1 :] + tail
        tail = block + tail
        end = start
    return 0, tail


def append_record(path: Path, record: Record) -> None:
    """Appends one record to `path` (its folder is created), mending a torn last line first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _mend_torn_tail(path)
    with path.open("a", encoding="utf-8") as out:
        out.write(record.to_line() + "\n")


class RecordWriter:
    """An open record file that a long-lived writer appends to, a flushed line per record (the
    trainer's step log). Opening it mends a torn last line left by a killed predecessor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        _mend_torn_tail(path)
        self._out: IO[str] | None = path.open("a", encoding="utf-8")

    def write(self, record: Record) -> None:
        if self._out is None:
            raise ValueError(f"{self.path}: the record writer is closed")
        self._out.write(record.to_line() + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


# -- reading ------------------------------------------------------------------------------------


def _parse(path: Path, number: int, line: bytes, model: type[R]) -> R:
    try:
        value = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}:{number}: not JSON ({exc})") from None
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'the line'}: {e['msg']}"
            for e in exc.errors()[:3]
        )
        raise RecordError(f"{path}:{number}: not a {model.__name__} ({problems})") from None


def read_records(path: Path, model: type[R]) -> list[R]:
    """The records of the JSONL file `path`, in order; none when it does not exist. Blank lines
    are skipped.

    One rule for a line that is not a record: a torn LAST line is dropped, any other such line
    is an error (`RecordError`, naming `path:line`). Torn means without its newline and not
    JSON: every writer appends a whole line at a time (`append_record`, `RecordWriter`), so
    that is what a writer killed in the middle of a line leaves, and what a reader sees while a
    line is being written; both are normal, and the record is simply not there yet (a writer
    that appends again mends it first). Anything else (garbage, a line that is JSON but not a
    record, a torn line that more lines follow) no writer leaves behind: the file was edited or
    a writer is wrong, and a report or an audit that skipped it would silently describe part
    of the run as all of it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    *lines, tail = data.split(b"\n")
    records = [
        _parse(path, number, line, model) for number, line in enumerate(lines, 1) if line.strip()
    ]
    if tail.strip():
        try:
            json.loads(tail)
        except (UnicodeDecodeError, json.JSONDecodeError):
            logger.debug("%s:%d: a torn last line, not a record yet", path, len(lines) + 1)
        else:
            records.append(_parse(path, len(lines) + 1, tail, model))
    return records


class RecordFollower(Generic[R]):
    """Reads a record file as it grows: `new_records()` returns the records appended since the
    last call, by the rule of `read_records`; a last line without its newline waits for it."""

    def __init__(self, path: Path, model: type[R]) -> None:
        self.path = path
        self.model = model
        self._offset = 0
        self._lines = 0  # complete lines read so far

    def new_records(self) -> list[R]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        lines = data[:end].split(b"\n")[:-1]
        records = [
            _parse(self.path, self._lines + number, line, self.model)
            for number, line in enumerate(lines, 1)
            if line.strip()
        ]
        self._offset += end
        self._lines += len(lines)
        return records
