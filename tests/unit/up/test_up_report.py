"""The end-of-run report: PNG plots, a self-contained HTML page with the key numbers, and the
one-paragraph summary, from a synthetic run directory; missing and corrupt inputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from relayrl.core.records import EvalRecord
from relayrl.up.defaults import resolve
from relayrl.up.report import (
    DPI,
    FIGSIZE,
    PLOTS,
    key_numbers,
    load_inputs,
    summary_text,
    write_report,
)
from relayrl.up.run_state import RunState
from relayrl.up.timing import RewardTiming, write_reward_timing

RUN_ID = "r-20261129-1234"
STARTED = 1_795_000_000.0
NUM_STEPS = 60
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def step_record(step: int) -> dict[str, Any]:
    """A trainer step as relayrl.trainer.metrics writes it. The first and last 6 steps (10%)
    have mean rewards 0.34 and 0.61; staleness 1, 1, 1, 2, 2 (mean 1.4, max 2)."""
    if step < 6:
        reward = 0.34
    elif step >= NUM_STEPS - 6:
        reward = 0.61
    else:
        reward = 0.34 + 0.27 * step / NUM_STEPS
    record: dict[str, Any] = {
        "step": step,
        "time": STARTED + 100 + step * 11,
        "reward_mean": reward,
        "reward_std": 0.2,
        "loss": 0.01,
        "staleness_mean": 1.4,
        "staleness_max": 2.0,
        "staleness_histogram": {"1": 3, "2": 2},
        "tokens_per_s": 400.0 + (step % 3) * 10,  # median 410
        "step_duration_s": 9.5,
        "trained_tokens": 3000.0,
        "groups": {"keep": 5, "no_signal": step % 2},
        "uids": [f"g{step}-{i}" for i in range(5)],
        "phases_s": {"wait": 1.0, "update": 7.0, "publish": 1.5},
    }
    if step % 10 != 7:  # some steps (as in bypass mode) have no mismatch metrics
        record["abs_log_ratio_mean"] = 0.01 + 0.001 * step
        record["abs_log_ratio_p99"] = 0.05 + 0.002 * step
    return record


def eval_record(kind: str, step: int, correct: int, n: int = 200) -> dict[str, Any]:
    return {
        "kind": kind,
        "step": step,
        "version": step,
        "version_end": step,
        "n": n,
        "correct": correct,
        "accuracy": correct / n,
        "sampled_accuracy": (correct - 10) / n,
        "seconds": 5.0,
        "time": STARTED + 60 + step * 10,
        "tokens": 4000,
        "failed": False,
        "error": "",
    }


def transfer_record(version: int, state: str = "committed") -> dict[str, Any]:
    durations = {"transport": 0.3, "pause_window": 0.5, "load": 0.4, "restore": 0.05}
    if version % 2:
        durations = {"transport": 0.35, "pause_window": 0.45, "load": 0.38}
    return {
        "version": version,
        "trainer_step": version,
        "state": state,
        "transport": "grpc",
        "bytes": 1_000_000,
        "replicas": ["engine-0"],
        "durations_s": durations if state == "committed" else {"transport": 0.2},
        "error": "" if state == "committed" else "load: replica engine-0 timed out",
        "time": STARTED + 100 + version * 11,
    }


def timing(step: int) -> RewardTiming:
    t0 = STARTED + 100 + step * 11
    return RewardTiming(
        step=step,
        num_groups=5,
        num_groups_without_events=0,
        num_trajectories=40,
        num_failed=1 if step == 3 else 0,
        num_scored=39 if step == 3 else 40,
        first_finished_time=t0,
        last_finished_time=t0 + 0.7,
        last_scored_time=t0 + 0.75,
        t_collect_s=0.05,
        overlap_ratio=0.93,
    )


def run_state(run_id: str = RUN_ID, **changes: Any) -> RunState:
    return RunState(
        run_id=run_id,
        task="arith",
        mode="separate_async",
        eta=1,
        steps=NUM_STEPS,
        warm_started=True,
        model_kind="tiny",
        training=resolve("tiny", {}, None, NUM_STEPS),
        started=STARTED,
        finished=STARTED + 672.0,  # 11.2 min
        state="completed",
    ).but(**changes)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    directory = tmp_path / RUN_ID
    directory.mkdir()
    run_state().write(directory)
    write_jsonl(directory / "trainer" / "steps.jsonl", [step_record(s) for s in range(NUM_STEPS)])
    evals = [eval_record("warm_start", 0, 63)]
    evals += [eval_record("periodic", s, 63 + s) for s in (10, 20, 30, 40, 50)]
    evals.append(eval_record("final", NUM_STEPS, 104))
    write_jsonl(directory / "eval.jsonl", evals)
    transfers = [transfer_record(v) for v in range(1, NUM_STEPS + 1)]
    transfers.insert(10, transfer_record(11, state="failed"))
    write_jsonl(directory / "weightsync" / "transfers.jsonl", transfers)
    write_reward_timing(directory, [timing(s) for s in range(NUM_STEPS)])
    return directory


def assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 5_000
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def test_full_run_writes_plots_page_and_summary(run_dir: Path) -> None:
    report = write_report(run_dir)

    assert list(report.plots) == list(PLOTS)
    assert report.no_data_plots == []
    for name, path in report.plots.items():
        assert path == run_dir / "report" / f"{name}.png"
        assert_valid_png(path)

    page = report.html_path.read_text()
    assert report.html_path == run_dir / "report.html"
    for name in PLOTS:
        assert f'src="report/{name}.png"' in page
    assert "<style>" in page and "<link" not in page and "<script" not in page

    n = report.numbers
    assert n.accuracy_gain_points == pytest.approx(20.5)
    assert '<td>Gain</td><td class="value">+20.5 points</td>' in page
    assert (n.warm_start_accuracy, n.final_accuracy, n.eval_n) == (0.315, 0.52, 200)
    assert n.reward_first == pytest.approx(0.34) and n.reward_last == pytest.approx(0.61)
    assert (n.staleness_mean, n.staleness_max) == (pytest.approx(1.4), 2)
    assert n.tokens_per_s_median == 410.0
    assert n.weight_sync_median_s == pytest.approx(0.8)  # transport + pause_window
    assert (n.num_transfers_committed, n.num_transfers_failed) == (NUM_STEPS, 1)
    assert (n.t_collect_median_s, n.overlap_median) == (0.05, 0.93)
    assert n.groups_trained == 5 * NUM_STEPS
    assert n.groups_rejected == {"no_signal": NUM_STEPS // 2}
    assert (n.trajectories_trained, n.trajectories_failed) == (40 * NUM_STEPS - 1, 1)

    summary = summary_text(report)
    assert summary == (
        f"Run {RUN_ID} trained arith for 60 steps in separate_async (η=1) in 11.2 min: "
        "held-out accuracy went from 31.5% (warm start) to 52.0% (+20.5 points, greedy, n=200); "
        "mean reward 0.34 → 0.61; staleness mean 1.4, max 2; 410 tokens/s; "
        "weight sync 0.8 s per version (median); reward t_collect 0.05 s, overlap 0.93; "
        "30 groups rejected: no_signal 30; no rollout failed."
    )
    assert "nan" not in summary.lower()
    assert summary in page  # nothing in it needs HTML escaping
    assert "no data" not in page


def test_missing_inputs_give_no_data_plots_and_a_short_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "r-empty"
    run_dir.mkdir()
    (run_dir / "eval.jsonl").write_text("")  # empty counts as missing

    report = write_report(run_dir)

    assert report.no_data_plots == list(PLOTS)
    for path in report.plots.values():
        assert_valid_png(path)
    page = report.html_path.read_text()
    for caption, _ in PLOTS.values():
        assert f"{caption} — no data" in page.replace("&quot;", '"')
    assert "Missing or empty inputs" in page and "trainer/steps.jsonl" in page
    assert report.unreadable == {}
    assert summary_text(report) == (
        "Run r-empty trained for 0 steps: no group rejected; no rollout failed."
    )


def test_partial_inputs_leave_out_what_they_lack(run_dir: Path) -> None:
    (run_dir / "reward_timing.jsonl").unlink()
    (run_dir / "weightsync" / "transfers.jsonl").unlink()
    run_state(finished=None, state="training").write(run_dir)
    # bypass mode: no mismatch metrics; one step logs a NaN reward
    records = [
        {k: v for k, v in step_record(s).items() if not k.startswith("abs_log_ratio")}
        for s in range(NUM_STEPS)
    ]
    records[30]["reward_mean"] = math.nan
    write_jsonl(run_dir / "trainer" / "steps.jsonl", records)
    evals = [eval_record("warm_start", 0, 63), eval_record("periodic", 40, 90)]
    write_jsonl(run_dir / "eval.jsonl", evals)

    report = write_report(run_dir)

    assert report.no_data_plots == ["log_ratio", "weight_sync", "reward_timing"]
    summary = summary_text(report)
    assert summary == (
        f"Run {RUN_ID} trained arith for 60 steps in separate_async (η=1): held-out accuracy "
        "went from 31.5% (warm start) to 45.0% (last eval at step 40, +13.5 points, greedy, "
        "n=200); mean reward 0.34 → 0.61; staleness mean 1.4, max 2; 410 tokens/s; "
        "30 groups rejected: no_signal 30; no rollout failed."
    )
    page = report.html_path.read_text()
    assert "duration <b>unfinished</b>" in page
    assert "no data" in page and "nan" not in page.lower()


def test_a_torn_last_line_is_left_out(run_dir: Path) -> None:
    clean = key_numbers(load_inputs(run_dir))
    with (run_dir / "trainer" / "steps.jsonl").open("a") as f:
        f.write('{"step": 60, "reward_mean": 0.9, "tok')  # a writer killed mid-line
    with (run_dir / "eval.jsonl").open("a") as f:
        f.write('{"kind": "final", "st')

    report = write_report(run_dir)

    assert report.unreadable == {}
    assert report.numbers == clean
    assert "unreadable" not in report.html_path.read_text()


def test_an_input_with_a_corrupt_line_is_left_out_whole_and_named_with_the_line(
    run_dir: Path,
) -> None:
    clean = key_numbers(load_inputs(run_dir))
    with (run_dir / "eval.jsonl").open("r+") as f:
        lines = f.readlines()
        f.seek(0)
        f.writelines([lines[0], "garbage\n", *lines[1:]])
    with (run_dir / "weightsync" / "transfers.jsonl").open("r+") as f:
        lines = f.readlines()
        f.seek(0)
        f.writelines([*lines[:3], '{"version": 4}\n', *lines[3:]])  # JSON, not a transfer

    report = write_report(run_dir)

    assert report.unreadable["eval.jsonl"] == (
        "eval.jsonl:2: not JSON (Expecting value: line 1 column 1 (char 0))"
    )
    assert report.unreadable["weightsync/transfers.jsonl"].startswith(
        "weightsync/transfers.jsonl:4: not a TransferRecord (trainer_step: Field required; "
    )
    assert set(report.unreadable) == {"eval.jsonl", "weightsync/transfers.jsonl"}
    n = report.numbers
    assert n.warm_start_accuracy is None and n.final_accuracy is None
    assert n.weight_sync_median_s is None and n.num_transfers_committed == 0
    assert (n.reward_first, n.tokens_per_s_median) == (clean.reward_first, 410.0)  # the rest
    assert report.no_data_plots == ["weight_sync"]  # the reward plot still has its top panel
    page = report.html_path.read_text()
    assert "Left out as unreadable (a line that is not a record): " in page
    assert "<code>eval.jsonl:2: not JSON" in page
    assert "; 2 inputs left out as unreadable (eval.jsonl:2: not JSON (" in summary_text(report)


def test_corrupt_run_json_is_named_and_the_directory_names_the_run(run_dir: Path) -> None:
    (run_dir / "run.json").write_text("{not json")
    report = write_report(run_dir)
    assert report.unreadable == {
        "run.json": "run.json: Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)"
    }
    assert report.run_id == RUN_ID and report.run is None
    assert summary_text(report).startswith(f"Run {RUN_ID} trained for 60 steps: held-out")


def test_a_run_json_of_the_wrong_shape_is_named_with_its_field(run_dir: Path) -> None:
    state = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps(state | {"eta": "one"}))
    report = write_report(run_dir)
    assert report.unreadable["run.json"].startswith("run.json: eta: Input should be a valid int")
    assert report.run is None and "Left out as unreadable" in report.html_path.read_text()


def test_importing_the_report_does_not_import_matplotlib() -> None:
    code = "import sys, relayrl.up.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_summary_gives_rejections_failures_wasted_tokens_and_why_the_run_stopped(
    tmp_path: Path,
) -> None:
    from relayrl.trainer.progress import ProgressLog, ProgressRecord

    directory = tmp_path / "r-stopped"
    directory.mkdir()
    run_state("r-stopped", steps=10, finished=None, state="stopped").write(directory)
    steps = []
    for step in range(2):
        steps.append(
            {
                "step": step,
                "time": STARTED + step,
                "reward_mean": 0.2,
                "groups": {"keep": 4, "no_signal": 6, "no_valid": 1},
                "no_signal": {"all scored 0": 5, "all scored 1": 1},
                "failures": {"EngineUnavailable: replica engine-0 is down": 8},
                "rollouts": 88.0,
                "failed_rollouts": 8.0,
                "generated_tokens": {"keep": 3000, "no_signal": 2000},
                "retried": {"no_valid": 1, "stale": step},
                "skipped": [
                    {
                        "prompt": 17,
                        "uid": "run-000000031",
                        "retries": 3,
                        "cause": "no_valid",
                        "reason": "4 of 4 rollouts failed (most common, 4x: EngineError: down)",
                    }
                ]
                if step
                else [],
                "uids": [f"g{step}-{i}" for i in range(4)],
            }
        )
    write_jsonl(directory / "trainer" / "steps.jsonl", steps)
    write_jsonl(
        directory / "eval.jsonl",
        [
            eval_record("warm_start", 0, 20),
            EvalRecord.failure("periodic", 1, "TimeoutError", 120.0).model_dump(),
        ],
    )
    log = ProgressLog(directory / "trainer" / "progress.jsonl")
    cause = "no step completed in 10m00s (the limit is 10m00s): step 2 has 0 of 4 groups; ..."
    log.append(
        ProgressRecord(
            kind="stopped", step=2, waited_s=600, wanted=4, consumed=9,
            rejected={"no_signal": 9}, no_signal={"all scored 0": 9}, rollouts=72, cause=cause,
        )
    )  # fmt: skip
    log.close()
    report = write_report(directory)
    n = report.numbers
    assert n.groups_rejected == {"no_signal": 21, "no_valid": 2}
    assert n.no_signal_reasons == {"all scored 0": 19, "all scored 1": 2}
    assert (n.rollouts, n.failed_rollouts) == (248, 16)
    assert n.wasted_tokens == pytest.approx(0.4) and n.generated_tokens == 10000
    assert n.failed_evals == ["periodic at step 1: TimeoutError"]
    assert n.stop_cause == cause
    assert n.groups_retried == {"no_valid": 2, "stale": 1}
    skipped = (
        "prompt 17 after 3 re-issues (no_valid: 4 of 4 rollouts failed (most common, 4x: "
        "EngineError: down))"
    )
    assert n.prompts_skipped == [skipped]
    summary = summary_text(report)
    assert (
        f"3 prompts re-issued (no_valid 2, stale 1), 1 skipped after the retry budget: {skipped}"
        in (summary)
    )
    assert "1 held-out evaluation FAILED (periodic at step 1: TimeoutError)" in summary
    assert "23 groups rejected: no_signal 21 (all scored 0 19, all scored 1 2), no_valid 2" in (
        summary
    )
    assert "40.0% of 10000 generated tokens in groups without signal" in summary
    assert (
        "16 of 248 rollouts failed as infrastructure (EngineUnavailable: replica engine-0 is "
        "down 16)" in summary
    )
    assert summary.endswith(f"stopped: {cause}.")
    assert report.unreadable == {}


def test_the_step_line_says_retried_and_skipped_only_when_there_were_any(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from relayrl.core.records import StepRecord
    from relayrl.up.progress import Progress

    supervisor = SimpleNamespace(children={}, run_dir=tmp_path)
    progress = Progress(tmp_path, supervisor, 20, lambda line: None)
    quiet = StepRecord(step=3, time=0.0, reward_mean=0.5)
    assert "retried" not in progress.line(quiet, {}, None)
    assert "skipped" not in progress.line(quiet, {}, None)
    skipped = {"prompt": 2, "uid": "run-1", "retries": 3, "cause": "stale", "reason": "stale"}
    busy = StepRecord(
        step=3, time=0.0, reward_mean=0.5, retried={"no_valid": 2, "stale": 1}, skipped=[skipped]
    )
    assert "reward 0.50  retried 3  skipped 1  " in progress.line(busy, {}, None)
