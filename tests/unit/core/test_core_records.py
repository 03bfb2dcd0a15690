"""`relayrl.core.records`: the run's JSONL records read back equal to what was written, with the
same JSON as before they were typed; one rule for a line that is not a record (a torn last line
is left out, any other is an error naming file:line); appending mends a torn last line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relayrl.core.records import (
    EvalRecord,
    RecordError,
    RecordFollower,
    RecordWriter,
    StepRecord,
    TransferRecord,
    append_record,
    read_records,
)

STEP_LINE = {
    "step": 3,
    "time": 1_795_000_000.25,
    "reward_mean": 0.5,
    "loss": -0.01,
    "kl": 0.002,
    "rollouts": 16.0,
    "rs_rule0_token_k3_rejected_token_frac": 0.125,  # named at run time: an extra field
    "publish_export_s": 0.3,
    "phases_s": {"wait": 1.5, "update": 2.0, "publish": 0.4},
    "groups": {"keep": 2, "no_signal": 1},
    "no_signal": {"all scored 0": 1},
    "failures": {},
    "generated_tokens": {"keep": 300, "no_signal": 90},
    "staleness_histogram": {"1": 1, "2": 1},
    "policy_lag_histogram": {"0": 2},
    "set_aside": [{"prompt": 7, "epoch": 1, "epochs": 2, "reason": "all scored 0"}],
    "retried": {"no_valid": 1},
    "skipped": [
        {"prompt": 3, "uid": "g0", "retries": 3, "cause": "stale", "reason": "staleness 3 > 2"}
    ],
    "uids": ["g1", "g2"],
    "row_tokens": [12, 14, 9, 11],
}
EVAL_LINE = {
    "kind": "periodic",
    "step": 10,
    "version": 10,
    "version_end": 11,
    "n": 200,
    "correct": 80,
    "accuracy": 0.4,
    "sampled_accuracy": None,
    "seconds": 12.5,
    "time": 1_795_000_100.0,
    "tokens": 5000,
    "failed": False,
    "error": "",
}
TRANSFER_LINE = {
    "version": 4,
    "trainer_step": 4,
    "state": "committed",
    "transport": "grpc",
    "bytes": 1_000_000,
    "replicas": ["engine-0", "engine-1"],
    "durations_s": {"transport": 0.3, "pause_window": 0.5},
    "error": "",
    "time": 1_795_000_200.5,
}


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize(
    ("model", "line"),
    [(StepRecord, STEP_LINE), (EvalRecord, EVAL_LINE), (TransferRecord, TRANSFER_LINE)],
)
def test_a_record_written_then_read_back_is_equal_and_keeps_its_json(
    tmp_path: Path, model: type[StepRecord | EvalRecord | TransferRecord], line: dict
) -> None:
    record = model.model_validate(line)
    path = tmp_path / "records.jsonl"
    append_record(path, record)
    append_record(path, record)
    assert read_records(path, model) == [record, record]
    assert [json.loads(x) for x in path.read_text().splitlines()] == [line, line]  # same JSON
    assert record.to_line() == json.dumps(line, sort_keys=True)


def test_step_record_fields_are_typed_and_an_extra_scalar_is_a_float() -> None:
    record = StepRecord.model_validate(STEP_LINE)
    assert record.staleness_histogram == {1: 1, 2: 1}
    assert record.set_aside[0].reason == "all scored 0"
    assert record.reward_mean == 0.5 and record.abs_log_ratio_mean is None  # not measured
    assert record.rs_rule0_token_k3_rejected_token_frac == 0.125
    with pytest.raises(ValueError, match="rs_rule0_token_k3_rejected_token_frac"):
        StepRecord.model_validate(STEP_LINE | {"rs_rule0_token_k3_rejected_token_frac": "x"})
    with pytest.raises(ValueError, match="groups"):
        StepRecord.model_validate(STEP_LINE | {"groups": {"keep": "two"}})


def test_a_non_finite_step_scalar_is_left_out_as_the_trainer_writes_it() -> None:
    record = StepRecord.model_validate(STEP_LINE | {"loss": float("nan"), "kl": float("inf")})
    assert record.loss is None and record.kl is None
    assert "loss" not in json.loads(record.to_line())


def test_the_trainers_gauges_are_named_step_fields() -> None:
    from relayrl.trainer.metrics import GAUGE_METRICS

    assert set(GAUGE_METRICS) <= set(StepRecord.model_fields)


def test_an_evaluation_has_an_accuracy_exactly_when_it_did_not_fail() -> None:
    failed = EvalRecord.failure("final", 20, "TimeoutError: no answer", 3.21)
    assert failed.failed and failed.accuracy is None and failed.version == -1
    assert EvalRecord.model_validate_json(failed.to_line()) == failed
    with pytest.raises(ValueError, match="accuracy exactly when it did not fail"):
        EvalRecord.model_validate(EVAL_LINE | {"accuracy": None})
    with pytest.raises(ValueError, match="kind"):
        EvalRecord.model_validate(EVAL_LINE | {"kind": "weekly"})


def test_a_missing_file_has_no_records_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    assert read_records(tmp_path / "absent.jsonl", TransferRecord) == []
    line = json.dumps(TRANSFER_LINE)
    path = write_lines(tmp_path / "t.jsonl", line + "\n", "\n", line + "\n")
    assert len(read_records(path, TransferRecord)) == 2


def test_a_torn_last_line_is_left_out(tmp_path: Path) -> None:
    line = json.dumps(TRANSFER_LINE)
    path = write_lines(tmp_path / "t.jsonl", line + "\n", line[:40])
    assert read_records(path, TransferRecord) == [TransferRecord.model_validate(TRANSFER_LINE)]
    # a whole record whose newline was not written yet is a record
    path = write_lines(tmp_path / "t.jsonl", line + "\n", line)
    assert len(read_records(path, TransferRecord)) == 2


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (["{line}\n", "garbage\n", "{line}\n"], r"t\.jsonl:2: not JSON \(Expecting value"),
        (["{line}\n", "{line}\n", "garbage\n"], r"t\.jsonl:3: not JSON"),  # ends with a newline
        (["{torn}", "{line}\n"], r"t\.jsonl:1: not JSON"),  # a torn line that others follow
        (
            ["{line}\n", '{"version": 5}\n'],
            r"t\.jsonl:2: not a TransferRecord \(trainer_step: Field required; ",
        ),
        (['{"version": 5, "state": "won"}'], r"t\.jsonl:1: not a TransferRecord .*state"),
    ],
)
def test_any_other_line_that_is_not_a_record_is_an_error_naming_file_and_line(
    tmp_path: Path, lines: list[str], error: str
) -> None:
    line = json.dumps(TRANSFER_LINE)
    text = [x.replace("{line}", line).replace("{torn}", line[:30]) for x in lines]
    path = write_lines(tmp_path / "t.jsonl", *text)
    with pytest.raises(RecordError, match=rf"^{re.escape(str(tmp_path))}/{error}"):
        read_records(path, TransferRecord)


def test_appending_mends_a_torn_last_line(tmp_path: Path) -> None:
    record = TransferRecord.model_validate(TRANSFER_LINE)
    line = record.to_line()
    path = write_lines(tmp_path / "t.jsonl", line + "\n", line[:50])  # a writer killed mid-line
    append_record(path, record)
    assert path.read_text() == f"{line}\n{line}\n"
    path = write_lines(tmp_path / "t.jsonl", line)  # killed just before the newline
    append_record(path, record)
    assert path.read_text() == f"{line}\n{line}\n"


def test_a_writer_restarted_after_a_kill_appends_after_the_last_whole_line(
    tmp_path: Path,
) -> None:
    record = StepRecord.model_validate(STEP_LINE)
    path = tmp_path / "trainer" / "steps.jsonl"
    first = RecordWriter(path)
    first.write(record)
    first.close()
    with path.open("a") as f:
        f.write(record.to_line()[:100])  # the next line, cut by SIGKILL
    second = RecordWriter(path)
    second.write(record)
    second.close()
    assert read_records(path, StepRecord) == [record, record]


def test_a_follower_returns_whole_lines_once_and_names_a_corrupt_one(tmp_path: Path) -> None:
    record = TransferRecord.model_validate(TRANSFER_LINE)
    line = record.to_line()
    path = tmp_path / "t.jsonl"
    follower = RecordFollower(path, TransferRecord)
    assert follower.new_records() == []  # not written yet
    path.write_text(line + "\n" + line[:20])
    assert follower.new_records() == [record]
    assert follower.new_records() == []  # the half line waits for its newline
    with path.open("a") as f:
        f.write(line[20:] + "\n" + "garbage\n")
    with pytest.raises(RecordError, match=rf"^{re.escape(str(path))}:3: not JSON"):
        follower.new_records()
