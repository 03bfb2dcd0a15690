"""The end-of-run report of `relayrl up`: `<run_dir>/report.html`, its PNG plots in
`<run_dir>/report/`, and a one-paragraph summary (`summary_text`) for stdout.

Inputs, all in the run directory; any of them may be missing or empty (a plot without data
says so). The JSONL ones are read by relayrl.core.records.read_records: a torn last line (a
writer killed in the middle of it) is left out, and an input with any other line that is not a
record is left out whole and named in the report with that line (`eval.jsonl:3: ...`):
    run.json                    relayrl.up.run_state.RunState, the run's own record; a
                                run.json that is not one is named as unreadable, with why
    trainer/steps.jsonl         StepRecord, one per trainer step; a step logged twice (re-run
                                after a resume) counts with its last record
    eval.jsonl                  EvalRecord, one per held-out evaluation
    weightsync/transfers.jsonl  TransferRecord, one per weight-sync transfer
    reward_timing.jsonl         relayrl.up.timing, computed from the TransferQueue after the run
    trainer/progress.jsonl      relayrl.trainer.progress records: what a step that never
                                completed had consumed, and why the run stopped

Step axes: per-step plots use the `step` of steps.jsonl (0-based: the record of step k is the
(k+1)-th update). An eval is drawn at its `step`, the number of steps completed when it started
(the warm start at 0), so the eval at x measured the weights that steps 0..x-1 trained.

matplotlib is imported when the plots are drawn, never on import of this module.
"""

from __future__ import annotations

import argparse
import html
import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from relayrl.core.records import (
    EvalRecord,
    Record,
    RecordError,
    StepRecord,
    TransferRecord,
    read_records,
)
from relayrl.trainer.progress import ProgressLog, ProgressRecord
from relayrl.up.run_state import RUN_FILE, RunState, RunStateError
from relayrl.up.timing import REWARD_TIMING_FILE, RewardTiming

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STEPS_FILE = "trainer/steps.jsonl"
EVAL_FILE = "eval.jsonl"
TRANSFERS_FILE = "weightsync/transfers.jsonl"
PROGRESS_FILE = "trainer/progress.jsonl"
HTML_FILE = "report.html"
PLOT_DIR = "report"

# Weight-sync boundaries in the order they happen. `pause_window` (rollout paused) contains
# the switch, load and restore of every replica, so a version's total is transport +
# pause_window, or transport + the others when pause_window was not recorded.
BOUNDARY_ORDER = ("export", "transport", "switch", "pause_window", "load", "restore")
INSIDE_PAUSE_WINDOW = frozenset({"switch", "load", "restore"})

FIGSIZE = (8.0, 4.5)
DPI = 100


R = TypeVar("R", bound=Record)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# -- inputs -------------------------------------------------------------------------------------


@dataclass
class RunInputs:
    """Everything the report reads."""

    run: RunState | None = None
    steps: list[StepRecord] = field(default_factory=list)  # by step, one per step
    evals: list[EvalRecord] = field(default_factory=list)  # with an accuracy, by (step, time)
    failed_evals: list[EvalRecord] = field(default_factory=list)  # by (step, time)
    transfers: list[TransferRecord] = field(default_factory=list)  # by version
    timings: list[RewardTiming] = field(default_factory=list)  # by step
    progress: list[ProgressRecord] = field(default_factory=list)  # the trainer's reports
    missing: list[str] = field(default_factory=list)  # inputs absent or empty
    unreadable: dict[str, str] = field(default_factory=dict)  # input -> why (`file:line: ...`)


def _read(inputs: RunInputs, run_dir: Path, name: str, model: type[R]) -> list[R]:
    """The records of one input; none (and the input named as unreadable, with the line) when
    a line that is not its torn last line is not a record."""
    try:
        records = read_records(run_dir / name, model)
    except RecordError as exc:
        inputs.unreadable[name] = str(exc).removeprefix(f"{run_dir}/")
        return []
    if not records:
        inputs.missing.append(name)
    return records


def load_inputs(run_dir: Path) -> RunInputs:
    """Reads the run directory's inputs; never raises for missing or corrupt ones."""
    inputs = RunInputs()
    try:
        inputs.run = RunState.read(run_dir)
    except FileNotFoundError:
        inputs.missing.append(RUN_FILE)
    except (OSError, RunStateError) as exc:
        inputs.unreadable[RUN_FILE] = str(exc).removeprefix(f"{run_dir}/")

    steps = _read(inputs, run_dir, STEPS_FILE, StepRecord)
    inputs.steps = sorted({r.step: r for r in steps}.values(), key=lambda r: r.step)
    evals = sorted(_read(inputs, run_dir, EVAL_FILE, EvalRecord), key=lambda r: (r.step, r.time))
    inputs.evals = [r for r in evals if not r.failed]
    inputs.failed_evals = [r for r in evals if r.failed]
    transfers = _read(inputs, run_dir, TRANSFERS_FILE, TransferRecord)
    inputs.transfers = sorted(transfers, key=lambda r: r.version)
    timings = _read(inputs, run_dir, REWARD_TIMING_FILE, RewardTiming)
    inputs.timings = sorted({t.step: t for t in timings}.values(), key=lambda t: t.step)
    inputs.progress = ProgressLog(run_dir / PROGRESS_FILE).read_all()
    return inputs


# -- key numbers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyNumbers:
    """The report's table. None: the inputs do not have it. Accuracies are fractions (0..1)."""

    num_steps: int = 0
    duration_s: float | None = None
    start_label: str = "warm start"  # what version 0 is: the warm start, or the given model
    warm_start_accuracy: float | None = None
    warm_start_sampled_accuracy: float | None = None
    final_accuracy: float | None = None
    final_sampled_accuracy: float | None = None
    final_eval_kind: str | None = None  # "final", or "periodic" when the run has no final eval
    final_eval_step: int | None = None
    eval_n: int | None = None
    accuracy_gain_points: float | None = None  # (final - warm start) * 100
    num_reward_steps_averaged: int = 0  # the 10% of steps each of reward_first/last averages
    reward_first: float | None = None  # mean reward_mean over the first 10% of steps
    reward_last: float | None = None  # ... and over the last 10%
    staleness_mean: float | None = None  # over every trained group
    staleness_max: int | None = None
    tokens_per_s_median: float | None = None
    weight_sync_median_s: float | None = None  # per committed transfer (transport + pause)
    num_transfers_committed: int = 0
    num_transfers_failed: int = 0
    t_collect_median_s: float | None = None
    overlap_median: float | None = None
    groups_trained: int | None = None
    groups_rejected: dict[str, int] = field(default_factory=dict)  # by trainer verdict
    no_signal_reasons: dict[str, int] = field(default_factory=dict)  # groups, by reason
    rollouts: int = 0  # consumed by the trainer, trained or not
    failed_rollouts: int = 0  # of them, failed as infrastructure
    failure_reasons: dict[str, int] = field(default_factory=dict)  # rollouts, by reason
    generated_tokens: int = 0  # response tokens of every consumed group
    wasted_tokens: float | None = None  # their share in groups without signal
    groups_retried: dict[str, int] = field(default_factory=dict)  # prompt re-issued, by cause
    prompts_skipped: list[str] = field(default_factory=list)  # "prompt <i> (<cause>: <reason>)"
    stop_cause: str | None = None  # why a stop rule ended the run
    failed_evals: list[str] = field(default_factory=list)  # "<kind> at step <n>: <error>"
    trained_tokens: float | None = None
    trajectories_trained: int | None = None  # scored trajectories of trained groups (TQ)
    trajectories_failed: int | None = None  # put as failed (rollout infrastructure)


def transfer_total_s(transfer: TransferRecord) -> float | None:
    """A transfer's duration from its per-boundary durations (see BOUNDARY_ORDER)."""
    durations = transfer.durations_s
    if not durations:
        return None
    skip = INSIDE_PAUSE_WINDOW if "pause_window" in durations else frozenset()
    return sum(v for k, v in durations.items() if k not in skip)


def _staleness_histogram(steps: list[StepRecord]) -> Counter[int]:
    """Trained groups by staleness, over every step."""
    histogram: Counter[int] = Counter()
    for record in steps:
        histogram.update(record.staleness_histogram)
    return histogram


def _staleness(steps: list[StepRecord]) -> tuple[float | None, int | None]:
    histogram = _staleness_histogram(steps)
    total = histogram.total()
    if not total:
        return None, None
    return sum(k * n for k, n in histogram.items()) / total, max(histogram)


def _evals(evals: list[EvalRecord]) -> dict[str, Any]:
    warm = next((e for e in evals if e.kind == "warm_start"), None)
    finals = [e for e in evals if e.kind == "final"]
    final = finals[-1] if finals else None
    if final is None:
        later = [e for e in evals if e is not warm and (warm is None or e.step > warm.step)]
        final = later[-1] if later else None
    out: dict[str, Any] = {}
    if warm is not None:
        out["warm_start_accuracy"] = warm.accuracy
        out["warm_start_sampled_accuracy"] = warm.sampled_accuracy
    if final is not None:
        out["final_accuracy"] = final.accuracy
        out["final_sampled_accuracy"] = final.sampled_accuracy
        out["final_eval_kind"] = "final" if final.kind == "final" else "periodic"
        out["final_eval_step"] = final.step
    if warm is not None and final is not None:
        assert warm.accuracy is not None and final.accuracy is not None  # not failed
        out["accuracy_gain_points"] = (final.accuracy - warm.accuracy) * 100
    reference = final or warm
    if reference is not None:
        out["eval_n"] = reference.n
    return out


def _retried(steps: list[StepRecord]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for record in steps:
        out.update(record.retried)
    return dict(out)


def _groups_trained(steps: list[StepRecord]) -> int | None:
    return sum(len(record.uids) for record in steps) if steps else None


@dataclass
class _Tally:
    """What the trainer consumed: rejected groups and failed rollouts, with reasons."""

    rejected: dict[str, int] = field(default_factory=dict)
    no_signal: dict[str, int] = field(default_factory=dict)
    rollouts: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # generated, by verdict

    def add(
        self,
        rejected: dict[str, int],
        no_signal: dict[str, int],
        failures: dict[str, int],
        tokens: dict[str, int],
    ) -> None:
        for into, counts in (
            (self.rejected, rejected), (self.no_signal, no_signal), (self.failures, failures),
        ):  # fmt: skip
            for key, n in counts.items():
                if key != "keep" and n:
                    into[key] = into.get(key, 0) + n
        for key, n in tokens.items():
            if n:
                self.tokens[key] = self.tokens.get(key, 0) + n


def _tally(steps: list[StepRecord], progress: list[ProgressRecord]) -> _Tally:
    """Every step's record, and the trainer's last report of a step that never completed."""
    tally = _Tally()
    for record in steps:
        tally.add(record.groups, record.no_signal, record.failures, record.generated_tokens)
        tally.rollouts += round(record.rollouts or 0)
        tally.failed += round(record.failed_rollouts or 0)
    done = max((r.step for r in steps), default=-1)
    pending = [r for r in progress if r.step > done]
    if pending:
        last = pending[-1]
        tally.add(last.rejected, last.no_signal, {last.top_failure: last.top_failure_count}, {})
        tally.rollouts += last.rollouts
        tally.failed += last.failed_rollouts
    return tally


def start_label(run: RunState | None) -> str:
    """Version 0 of a run: its warm start, or the model it was given."""
    return "warm start" if run is not None and run.warm_started else "start"


def key_numbers(inputs: RunInputs) -> KeyNumbers:
    steps = inputs.steps
    rewards = [r.reward_mean for r in steps if r.reward_mean is not None]
    k = max(1, math.ceil(len(rewards) / 10)) if rewards else 0
    staleness_mean, staleness_max = _staleness(steps)
    committed = [t for t in inputs.transfers if t.state == "committed"]
    sync_s = [v for t in committed if (v := transfer_total_s(t)) is not None]
    tokens = [r.trained_tokens for r in steps if r.trained_tokens is not None]
    groups_trained = _groups_trained(steps)
    tally = _tally(steps, inputs.progress)
    stopped = [r for r in inputs.progress if r.kind == "stopped"]
    timings = inputs.timings
    return KeyNumbers(
        num_steps=len(steps),
        duration_s=inputs.run.duration_s if inputs.run else None,
        start_label=start_label(inputs.run),
        **_evals(inputs.evals),
        num_reward_steps_averaged=k,
        reward_first=statistics.fmean(rewards[:k]) if rewards else None,
        reward_last=statistics.fmean(rewards[-k:]) if rewards else None,
        staleness_mean=staleness_mean,
        staleness_max=staleness_max,
        tokens_per_s_median=_median([r.tokens_per_s for r in steps if r.tokens_per_s is not None]),
        weight_sync_median_s=_median(sync_s),
        num_transfers_committed=len(committed),
        num_transfers_failed=sum(t.state == "failed" for t in inputs.transfers),
        t_collect_median_s=_median([t.t_collect_s for t in timings if t.t_collect_s is not None]),
        overlap_median=_median([t.overlap_ratio for t in timings if t.overlap_ratio is not None]),
        groups_trained=groups_trained,
        groups_rejected=tally.rejected,
        no_signal_reasons=tally.no_signal,
        rollouts=tally.rollouts,
        failed_rollouts=tally.failed,
        failure_reasons=tally.failures,
        generated_tokens=sum(tally.tokens.values()),
        wasted_tokens=(
            tally.tokens.get("no_signal", 0) / sum(tally.tokens.values())
            if sum(tally.tokens.values())
            else None
        ),
        groups_retried=_retried(steps),
        prompts_skipped=[
            f"prompt {s.prompt} after {s.retries} re-issues ({s.cause}: {s.reason})"
            for r in steps
            for s in r.skipped
        ],
        stop_cause=stopped[-1].cause if stopped else None,
        failed_evals=[
            f"{r.kind} at step {r.step}: {r.error}".rstrip(": ") for r in inputs.failed_evals
        ],
        trained_tokens=sum(tokens) if tokens else None,
        trajectories_trained=sum(t.num_scored for t in timings) if timings else None,
        trajectories_failed=sum(t.num_failed for t in timings) if timings else None,
    )


# -- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    run_dir: Path
    html_path: Path
    plots: dict[str, Path]  # plot name -> PNG, in page order
    no_data_plots: list[str]  # plots drawn without any data
    run_id: str
    run: RunState | None  # None: run.json missing or unreadable
    numbers: KeyNumbers
    missing_inputs: list[str]  # inputs absent or empty
    unreadable: dict[str, str]  # input -> the line that is not a record (`file:line: why`)


def write_report(run_dir: Path) -> Report:
    """Reads the run directory, draws the plots into `run_dir/report/` and writes
    `run_dir/report.html`. Missing or unreadable inputs never fail it."""
    run_dir = Path(run_dir)
    inputs = load_inputs(run_dir)
    plots, no_data = draw_plots(inputs, run_dir / PLOT_DIR)
    run = inputs.run
    report = Report(
        run_dir=run_dir,
        html_path=run_dir / HTML_FILE,
        plots=plots,
        no_data_plots=no_data,
        run_id=run.run_id if run else run_dir.name,
        run=run,
        numbers=key_numbers(inputs),
        missing_inputs=inputs.missing,
        unreadable=inputs.unreadable,
    )
    report.html_path.write_text(render_html(report), encoding="utf-8")
    return report


# -- text ---------------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value:.2g}" if value < 1 else f"{value:.1f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def _accuracy_clause(n: KeyNumbers) -> str | None:
    sample = "greedy" + (f", n={n.eval_n}" if n.eval_n else "")
    final_label = "" if n.final_eval_kind == "final" else f"last eval at step {n.final_eval_step}, "
    if n.warm_start_accuracy is not None and n.final_accuracy is not None:
        gain = n.accuracy_gain_points or 0.0
        return (
            f"held-out accuracy went from {_percent(n.warm_start_accuracy)} ({n.start_label}) to "
            f"{_percent(n.final_accuracy)} ({final_label}{gain:+.1f} points, {sample})"
        )
    if n.warm_start_accuracy is not None:
        return f"held-out accuracy {_percent(n.warm_start_accuracy)} at {n.start_label} ({sample})"
    if n.final_accuracy is not None:
        return f"held-out accuracy {_percent(n.final_accuracy)} ({final_label}{sample})"
    return None


def _clauses(n: KeyNumbers, unreadable: dict[str, str]) -> list[str]:
    clauses = []
    if (accuracy := _accuracy_clause(n)) is not None:
        clauses.append(accuracy)
    if n.reward_first is not None and n.reward_last is not None:
        clauses.append(f"mean reward {n.reward_first:.2f} → {n.reward_last:.2f}")
    staleness = []
    if n.staleness_mean is not None:
        staleness.append(f"mean {n.staleness_mean:.1f}")
    if n.staleness_max is not None:
        staleness.append(f"max {n.staleness_max}")
    if staleness:
        clauses.append("staleness " + ", ".join(staleness))
    if n.tokens_per_s_median is not None:
        clauses.append(f"{_rate(n.tokens_per_s_median)} tokens/s")
    if n.weight_sync_median_s is not None:
        clauses.append(f"weight sync {_seconds(n.weight_sync_median_s)} s per version (median)")
    reward = []
    if n.t_collect_median_s is not None:
        reward.append(f"t_collect {_seconds(n.t_collect_median_s)} s")
    if n.overlap_median is not None:
        reward.append(f"overlap {n.overlap_median:.2f}")
    if reward:
        clauses.append("reward " + ", ".join(reward))
    if n.failed_evals:
        clauses.append(
            f"{len(n.failed_evals)} held-out evaluation{'s' * (len(n.failed_evals) != 1)} "
            f"FAILED ({'; '.join(n.failed_evals[:2])})"
        )
    clauses.append(_rejected_clause(n))
    if n.wasted_tokens is not None:
        clauses.append(
            f"{_percent(n.wasted_tokens)} of {n.generated_tokens} generated tokens in groups "
            "without signal"
        )
    clauses.append(_failed_clause(n))
    if (retries := _retries_clause(n)) is not None:
        clauses.append(retries)
    if n.stop_cause is not None:
        clauses.append(f"stopped: {n.stop_cause}")
    if unreadable:
        clauses.append(
            f"{len(unreadable)} input{'s' * (len(unreadable) != 1)} left out as unreadable "
            f"({'; '.join(unreadable[name] for name in sorted(unreadable))})"
        )
    return clauses


def _by_count(counts: dict[str, int], limit: int = 3) -> str:
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{key} {n}" for key, n in ranked[:limit])
    return text + (", ..." if len(ranked) > limit else "")


def _rejected_clause(n: KeyNumbers) -> str:
    """Always there: how many groups the trainer rejected, and why."""
    total = sum(n.groups_rejected.values())
    if not total:
        return "no group rejected"
    parts = []
    for verdict, count in sorted(n.groups_rejected.items(), key=lambda kv: -kv[1]):
        reasons = n.no_signal_reasons if verdict == "no_signal" else {}
        detail = f" ({_by_count(reasons)})" if reasons else ""
        parts.append(f"{verdict} {count}{detail}")
    return f"{total} group{'s' * (total != 1)} rejected: " + ", ".join(parts)


def _retries_clause(n: KeyNumbers) -> str | None:
    """Prompts re-issued for reasons outside the policy, and those given up, when any."""
    retried = sum(n.groups_retried.values())
    if not retried and not n.prompts_skipped:
        return None
    text = (
        f"{retried} prompt{'s' * (retried != 1)} re-issued ({_by_count(n.groups_retried)})"
        if retried
        else "no prompt re-issued"
    )
    if n.prompts_skipped:
        text += (
            f", {len(n.prompts_skipped)} skipped after the retry budget: "
            + "; ".join(n.prompts_skipped[:2])
            + ("; ..." if len(n.prompts_skipped) > 2 else "")
        )
    return text


def _failed_clause(n: KeyNumbers) -> str:
    """Always there: how many rollouts failed as infrastructure, and the most common reasons."""
    if not n.failed_rollouts:
        return f"no rollout failed (of {n.rollouts})" if n.rollouts else "no rollout failed"
    return (
        f"{n.failed_rollouts} of {n.rollouts} rollouts failed as infrastructure "
        f"({_by_count(n.failure_reasons, 2)})"
    )


def summary_text(report: Report) -> str:
    """One paragraph: what the run trained, how long, and its key numbers. A number the inputs
    lack is left out of the sentence."""
    n, run = report.numbers, report.run
    text = f"Run {report.run_id} trained" + (f" {run.task}" if run else "")
    steps = f"{n.num_steps}"
    if run and run.steps != n.num_steps:
        steps += f" of {run.steps}"
    text += f" for {steps} step{'s' * (steps != '1')}"
    if run:
        text += f" in {run.mode} (η={run.eta})"
    if n.duration_s is not None:
        text += f" in {_duration(n.duration_s)}"
    clauses = _clauses(n, report.unreadable)
    return text + (": " + "; ".join(clauses) if clauses else "") + "."


def table_rows(report: Report) -> list[tuple[str, str]]:
    """(label, value) rows of the key-number table; "no data" where the inputs lack it."""
    n = report.numbers
    none = "no data"

    def accuracy(value: float | None, sampled: float | None, where: str) -> str:
        if value is None:
            return none
        text = _percent(value) + where
        return text + (f" (sampled: {_percent(sampled)})" if sampled is not None else "")

    final_where = ""
    if n.final_eval_step is not None:
        final_where = f" at step {n.final_eval_step}" + (
            "" if n.final_eval_kind == "final" else " (no final eval: the last one)"
        )
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(n.groups_rejected.items()))
    k = f" ({n.num_reward_steps_averaged})" if n.num_reward_steps_averaged else ""
    return [
        (
            f"Held-out accuracy, {n.start_label} (greedy)",
            accuracy(n.warm_start_accuracy, n.warm_start_sampled_accuracy, ""),
        ),
        (
            "Held-out accuracy, final (greedy)",
            accuracy(n.final_accuracy, n.final_sampled_accuracy, final_where),
        ),
        (
            "Gain",
            none if n.accuracy_gain_points is None else f"{n.accuracy_gain_points:+.1f} points",
        ),
        ("Eval size", none if n.eval_n is None else f"{n.eval_n} prompts"),
        (f"Mean reward, first 10% of steps{k}", _fixed(n.reward_first, 3)),
        (f"Mean reward, last 10% of steps{k}", _fixed(n.reward_last, 3)),
        ("Staleness, mean over trained groups", _fixed(n.staleness_mean, 2)),
        ("Staleness, max", none if n.staleness_max is None else str(n.staleness_max)),
        (
            "Tokens/s (median over steps)",
            none if n.tokens_per_s_median is None else _rate(n.tokens_per_s_median),
        ),
        (
            "Weight sync per version (median)",
            none if n.weight_sync_median_s is None else f"{_seconds(n.weight_sync_median_s)} s",
        ),
        (
            "Weight-sync transfers",
            f"{n.num_transfers_committed} committed, {n.num_transfers_failed} failed"
            if n.num_transfers_committed or n.num_transfers_failed
            else none,
        ),
        (
            "Reward t_collect (median)",
            none if n.t_collect_median_s is None else f"{_seconds(n.t_collect_median_s)} s",
        ),
        ("Reward overlap ratio (median)", _fixed(n.overlap_median, 2)),
        (
            "Groups trained",
            none
            if n.groups_trained is None
            else f"{n.groups_trained}" + (f" (rejected: {rejected})" if rejected else ""),
        ),
        (
            "Prompts re-issued / skipped (retry budget)",
            none
            if n.groups_trained is None
            else f"{sum(n.groups_retried.values())} / {len(n.prompts_skipped)}",
        ),
        (
            "Trajectories of trained groups, scored",
            none if n.trajectories_trained is None else str(n.trajectories_trained),
        ),
        (
            "Trajectories of trained groups, failed in rollout (infra)",
            none if n.trajectories_failed is None else str(n.trajectories_failed),
        ),
        ("Tokens trained", none if n.trained_tokens is None else f"{n.trained_tokens:.0f}"),
    ]


def _fixed(value: float | None, digits: int) -> str:
    return "no data" if value is None else f"{value:.{digits}f}"


# -- plots --------------------------------------------------------------------------------------


def _no_data(ax: Any, reason: str = "") -> None:
    ax.text(
        0.5,
        0.55,
        "no data",
        ha="center",
        va="center",
        fontsize=16,
        color="0.45",
        transform=ax.transAxes,
    )
    if reason:
        ax.text(
            0.5,
            0.4,
            reason,
            ha="center",
            va="center",
            fontsize=9,
            color="0.45",
            transform=ax.transAxes,
        )
    # tick_params, not set_xticks: the x axis may be shared with a panel that has data
    ax.tick_params(bottom=False, left=False, labelbottom=False, labelleft=False)


def _series(
    records: list[StepRecord], value: Callable[[StepRecord], float | None]
) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if (v := value(r)) is not None:
            xs.append(r.step)
            ys.append(v)
    return xs, ys


def _style(n: int) -> dict[str, Any]:
    return {"marker": "o", "markersize": 3} if n <= 60 else {}


def plot_reward_accuracy(fig: Figure, inputs: RunInputs) -> bool:
    top, bottom = fig.subplots(2, 1, sharex=True)
    xs, ys = _series(inputs.steps, lambda r: r.reward_mean)
    if xs:
        top.plot(xs, ys, color="tab:blue", label="reward_mean", **_style(len(xs)))
        std_x, std = _series(inputs.steps, lambda r: r.reward_std)
        if std_x == xs:
            lo = [y - s for y, s in zip(ys, std, strict=True)]
            hi = [y + s for y, s in zip(ys, std, strict=True)]
            top.fill_between(xs, lo, hi, color="tab:blue", alpha=0.15, label="± reward_std")
        top.set_ylabel("reward (trained rows)")
        top.legend(loc="best", fontsize=8)
        top.grid(alpha=0.3)
    else:
        _no_data(top, f"{STEPS_FILE}: no reward_mean")
    evals = inputs.evals
    if evals:
        steps = [e.step for e in evals]
        bottom.plot(
            steps,
            [(e.accuracy or 0.0) * 100 for e in evals],
            color="tab:green",
            marker="o",
            markersize=4,
            label="held-out accuracy (greedy)",
        )
        sampled = [
            (e.step, e.sampled_accuracy * 100) for e in evals if e.sampled_accuracy is not None
        ]
        if sampled:
            bottom.plot(
                *zip(*sampled, strict=True),
                color="tab:olive",
                linestyle="--",
                marker=".",
                label="held-out accuracy (sampled)",
            )
        first = start_label(inputs.run)
        for kind, marker, label in (("warm_start", "*", first), ("final", "s", "final")):
            for marked in (e for e in evals if e.kind == kind):
                point = (marked.step, (marked.accuracy or 0.0) * 100)
                bottom.plot(*point, marker=marker, markersize=12, color="tab:red", linestyle="none")
                bottom.annotate(
                    f"{label} {point[1]:.1f}%",
                    point,
                    textcoords="offset points",
                    xytext=(6, 6),
                    fontsize=8,
                )
        bottom.set_ylabel("held-out accuracy (%)")
        bottom.set_xlabel("trainer step (evals: steps completed)")
        bottom.legend(loc="best", fontsize=8)
        bottom.grid(alpha=0.3)
    else:
        _no_data(bottom, f"{EVAL_FILE}: no evaluation")
        if xs:  # the shared x axis shows its ticks on the top panel instead
            top.tick_params(labelbottom=True)
            top.set_xlabel("trainer step")
    fig.suptitle("Reward per step and held-out accuracy")
    return bool(xs or evals)


def plot_staleness(fig: Figure, inputs: RunInputs) -> bool:
    ax = fig.subplots()
    histogram = _staleness_histogram(inputs.steps)
    if not histogram:
        _no_data(ax, f"{STEPS_FILE}: no staleness_histogram")
        return False
    keys = sorted(histogram)
    ax.bar(keys, [histogram[k] for k in keys], color="tab:purple")
    ax.set_xticks(keys)
    ax.set_xlabel("staleness (step - prompt step + 1; 1 = on-policy batch)")
    ax.set_ylabel("trained groups")
    ax.set_title("Staleness of trained groups (all steps)")
    ax.grid(axis="y", alpha=0.3)
    return True


def plot_log_ratio(fig: Figure, inputs: RunInputs) -> bool:
    ax = fig.subplots()
    drawn = False
    value: Callable[[StepRecord], float | None]
    for value, label, color in (
        (lambda r: r.abs_log_ratio_mean, "mean", "tab:blue"),
        (lambda r: r.abs_log_ratio_p99, "p99", "tab:orange"),
    ):
        xs, ys = _series(inputs.steps, value)
        if xs:
            ax.plot(xs, ys, label=label, color=color, **_style(len(xs)))
            drawn = True
    if not drawn:
        _no_data(ax, "no abs_log_ratio_* in the step records (bypass mode?)")
        return False
    _label(
        ax,
        "trainer step",
        "|log π_old - log μ| per token",
        "Trainer vs rollout log-prob mismatch",
    )
    return True


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, title, legend and grid: how every single-panel plot ends."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)


def plot_tokens_per_s(fig: Figure, inputs: RunInputs) -> bool:
    ax = fig.subplots()
    xs, ys = _series(inputs.steps, lambda r: r.tokens_per_s)
    if not xs:
        _no_data(ax, f"{STEPS_FILE}: no tokens_per_s")
        return False
    ax.plot(xs, ys, color="tab:blue", label="tokens/s", **_style(len(xs)))
    median = statistics.median(ys)
    ax.axhline(median, color="0.4", linestyle="--", label=f"median {_rate(median)}")
    _label(ax, "trainer step", "trained tokens / s (excluding wait)", "Trainer throughput")
    return True


def plot_weight_sync(fig: Figure, inputs: RunInputs) -> bool:
    ax = fig.subplots()
    committed = [t for t in inputs.transfers if t.state == "committed"]
    boundaries: set[str] = set()
    for t in committed:
        boundaries.update(t.durations_s)
    order = [b for b in BOUNDARY_ORDER if b in boundaries] + sorted(
        boundaries - set(BOUNDARY_ORDER)
    )
    drawn = False
    for boundary in order:
        points = [
            (t.version, t.durations_s[boundary]) for t in committed if boundary in t.durations_s
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=boundary)
            drawn = True
    totals = [(t.version, v) for t in committed if (v := transfer_total_s(t)) is not None]
    if len(order) > 1 and totals:
        ax.plot(*zip(*totals, strict=True), color="black", linewidth=2, label="total")
    failed = [t.version for t in inputs.transfers if t.state == "failed"]
    for i, version in enumerate(failed):
        ax.axvline(version, color="tab:red", linestyle=":", label="failed" if i == 0 else None)
    if not drawn and not failed:
        _no_data(ax, f"{TRANSFERS_FILE}: no transfer with durations")
        return False
    ax.set_ylim(bottom=0)
    _label(
        ax,
        "weight version",
        "seconds",
        "Weight-sync duration per boundary (pause_window contains load and restore)",
    )
    return True


def plot_reward_timing(fig: Figure, inputs: RunInputs) -> bool:
    top, bottom = fig.subplots(2, 1, sharex=True)
    collect = [(t.step, t.t_collect_s) for t in inputs.timings if t.t_collect_s is not None]
    overlap = [(t.step, t.overlap_ratio) for t in inputs.timings if t.overlap_ratio is not None]
    if not collect:
        _no_data(top, f"{REWARD_TIMING_FILE}: no step with a scored trajectory")
        _no_data(bottom)
        return False
    top.plot(*zip(*collect, strict=True), color="tab:orange", **_style(len(collect)))
    top.set_ylabel("t_collect (s)")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    bottom.plot(*zip(*overlap, strict=True), color="tab:green", **_style(len(overlap)))
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_ylabel("overlap ratio")
    bottom.set_xlabel("trainer step")
    bottom.grid(alpha=0.3)
    fig.suptitle("Reward wait after rollout (t_collect) and reward hidden behind rollout")
    return True


# name -> (caption, plot function); the page shows them in this order.
PLOTS: dict[str, tuple[str, Callable[[Figure, RunInputs], bool]]] = {
    "reward_accuracy": ("Reward per step and held-out accuracy", plot_reward_accuracy),
    "staleness": ("Staleness histogram of trained groups, all steps", plot_staleness),
    "log_ratio": ("|log π_old - log μ| per step (mean and p99)", plot_log_ratio),
    "tokens_per_s": ("Trainer tokens/s per step", plot_tokens_per_s),
    "weight_sync": ("Weight-sync duration per boundary, per version", plot_weight_sync),
    "reward_timing": ("Reward t_collect and overlap ratio per step", plot_reward_timing),
}


def draw_plots(inputs: RunInputs, plot_dir: Path) -> tuple[dict[str, Path], list[str]]:
    """Writes one PNG per entry of PLOTS; returns their paths and the names without data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plot_dir.mkdir(parents=True, exist_ok=True)
    paths, no_data = {}, []
    for name, (_, draw) in PLOTS.items():
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)  # no display backend, no pyplot state
        if not draw(fig, inputs):
            no_data.append(name)
        path = plot_dir / f"{name}.png"
        fig.savefig(path, format="png")
        paths[name] = path
    return paths, no_data


# -- HTML ---------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 60rem; padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.5rem; margin-bottom: 0.2rem; }
.meta { color: #555; margin-top: 0; }
.meta b { color: #222; }
.summary { background: #f4f6fa; border-left: 4px solid #4a7bd0; padding: 0.8rem 1rem; }
.notice { background: #fff6e0; border-left: 4px solid #e0a020; padding: 0.5rem 1rem; }
table { border-collapse: collapse; margin: 1rem 0; }
td { border-bottom: 1px solid #ddd; padding: 0.3rem 1rem 0.3rem 0; vertical-align: top; }
td.value { font-variant-numeric: tabular-nums; font-weight: 600; }
td.nodata { color: #999; font-weight: normal; }
figure { margin: 1.5rem 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9rem; }
pre { background: #f7f7f7; padding: 0.5rem; overflow-x: auto; font-size: 0.8rem; }
"""


def _header(report: Report) -> str:
    e = html.escape
    n, run = report.numbers, report.run
    items = []
    if run:
        items += [f"task <b>{e(run.task)}</b>", f"mode <b>{e(run.mode)}</b>", f"η <b>{run.eta}</b>"]
    items.append(f"steps <b>{n.num_steps}" + (f" of {run.steps}" if run else "") + "</b>")
    if n.duration_s is not None:
        items.append(f"duration <b>{_duration(n.duration_s)}</b>")
    elif run:
        items.append("duration <b>unfinished</b>")
    if run:
        when = datetime.fromtimestamp(run.started, UTC).strftime("%Y-%m-%d %H:%M UTC")
        items.append(f"started <b>{when}</b>")
    return (
        f"<h1>relayrl run <code>{e(report.run_id)}</code></h1>\n"
        f'<p class="meta">{" · ".join(items)}</p>\n'
    )


def _notices(report: Report) -> str:
    e = html.escape
    lines = []
    if report.missing_inputs:
        names = ", ".join(f"<code>{e(m)}</code>" for m in report.missing_inputs)
        lines.append(f"Missing or empty inputs: {names}.")
    if report.unreadable:
        items = "; ".join(
            f"<code>{e(report.unreadable[name])}</code>" for name in sorted(report.unreadable)
        )
        lines.append(f"Left out as unreadable (a line that is not a record): {items}.")
    if not lines:
        return ""
    return '<div class="notice">' + "<br>\n".join(lines) + "</div>\n"


def render_html(report: Report) -> str:
    """The self-contained page: inline CSS, images referenced as report/<name>.png."""
    e = html.escape
    rows = []
    for label, value in table_rows(report):
        css = "value nodata" if value == "no data" else "value"
        rows.append(f'<tr><td>{e(label)}</td><td class="{css}">{e(value)}</td></tr>')
    figures = []
    for name, path in report.plots.items():
        caption = PLOTS[name][0] + (" — no data" if name in report.no_data_plots else "")
        src = f"{PLOT_DIR}/{path.name}"
        figures.append(
            f'<figure id="{e(name)}"><img src="{e(src)}" alt="{e(caption)}">'
            f"<figcaption>{e(caption)}</figcaption></figure>"
        )
    run_json = report.run.model_dump_json(indent=2) if report.run else "(none)"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>relayrl run {e(report.run_id)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        + _header(report)
        + _notices(report)
        + f'<p class="summary">{e(summary_text(report))}</p>\n'
        + '<h2>Key numbers</h2>\n<table class="numbers">\n'
        + "\n".join(rows)
        + "\n</table>\n<h2>Plots</h2>\n"
        + "\n".join(figures)
        + f"\n<details><summary>run.json</summary><pre>{e(run_json)}</pre></details>\n"
        + "</body>\n</html>\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m relayrl.up.report RUN_DIR`: (re)writes a run's report, prints its summary."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("run_dir", type=Path, help="the run directory (runs/<id>)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        parser.error(f"{args.run_dir} is not a directory")
    report = write_report(args.run_dir)
    print(summary_text(report))
    print(f"report: {report.html_path}")


if __name__ == "__main__":
    main()
