"""`relayrl sim`: simulate a rollout pipeline design, or recommend a staleness bound (the
source's reference figures are reproduced by bench/sim_reproduce.py). Only argparse is
imported here: the simulator, numpy and matplotlib load when the command runs, so
`relayrl --help` stays instant."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from relayrl.sim.pipeline import PipelineConfig, SimResult
    from relayrl.sim.sources import DurationSource

DESIGNS = ("sync", "one_step_drain", "partial")
EXIT_USAGE = 2
# PipelineConfig field -> the flag that sets it (validation messages name the flag).
FLAG_OF_FIELD = {
    "n_slots": "--slots",
    "batch_size": "--batch-size",
    "train_time_s": "--train-time-s",
    "sync_time_s": "--sync-time-s",
    "steps": "--steps",
    "eta": "--eta",
    "timeout_s": "--timeout-s",
    "timeout_policy": "--timeout-policy",
    "failure_hazard_per_s": "--failure-hazard-per-s",
    "failure_policy": "--failure-policy",
    "failure_seed": "--seed",
}
HISTOGRAM_WIDTH = 40


def _one_line_error(prog: str):
    def error(message: str) -> NoReturn:
        # argparse would print the usage too; relayrl's mistakes are one line (see relayrl.cli).
        print(f"{prog}: {message} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    return error


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `relayrl sim` on the `relayrl` subparsers."""
    sim = sub.add_parser(
        "sim",
        help="simulate a rollout pipeline (throughput, utilisation, staleness)",
        description="A discrete-event simulation of a rollout pipeline (docs/simulation.md): N "
        "generation slots, a trainer taking B finished rollouts per step, weight syncs that "
        "pause generation. Prints rollouts/hour, slot utilisation, staleness of trained "
        "rollouts and more; --recommend sweeps eta. Durations come from the episode model "
        "unless a file or Prometheus gives them.",
    )
    sim.error = _one_line_error("relayrl sim")  # type: ignore[method-assign]
    sim.add_argument(
        "--recommend",
        action="store_true",
        help="sweep eta 0..8 and recommend the smallest good one",
    )
    design = sim.add_argument_group("design")
    design.add_argument("--design", choices=DESIGNS, help="default partial")
    design.add_argument("--eta", type=int, help="staleness bound of the throttle (default 1)")
    design.add_argument("--drain", action="store_true", help="syncs wait for in-flight rollouts")
    design.add_argument(
        "--drop-stale", action="store_true", help="the trainer drops rollouts staler than eta"
    )
    design.add_argument("--slots", type=int, help="generation slots (default 64)")
    design.add_argument("--batch-size", type=int, help="rollouts per train step (default 64)")
    design.add_argument("--train-time-s", type=float, help="seconds per train step (default 60)")
    design.add_argument("--sync-time-s", type=float, help="seconds per weight sync (default 10)")
    design.add_argument("--steps", type=int, help="train steps to simulate (default 20)")
    design.add_argument("--timeout-s", type=float, help="cut rollouts running longer")
    design.add_argument(
        "--timeout-policy", choices=("truncate", "drop"), help="a cut rollout: (default truncate)"
    )
    design.add_argument(
        "--failure-hazard-per-s", type=float, help="worker failures per second of running time"
    )
    design.add_argument(
        "--failure-policy", choices=("drop", "retry"), help="a failed rollout: (default drop)"
    )
    design.add_argument(
        "--no-train-during-sync",
        action="store_true",
        help="the trainer waits for its sync to end before its next step (relayrl's trainer)",
    )
    source = sim.add_argument_group("durations (default: the episode model)")
    source.add_argument("--seed", type=int, default=0, help="durations (and failures) seed")
    source.add_argument(
        "--model-param",
        action="append",
        metavar="NAME=VALUE",
        help="override an EpisodeModel parameter (repeatable), e.g. turn_p=0.1",
    )
    where = source.add_mutually_exclusive_group()
    where.add_argument("--durations-file", type=Path, metavar="F", help="seconds per line, or JSON")
    where.add_argument(
        "--durations-from-prometheus",
        metavar="URL",
        help="the gateway's rollout-duration histogram in this Prometheus",
    )
    source.add_argument("--window", help="Prometheus range (default 1h)")
    output = sim.add_argument_group("output")
    output.add_argument("--json", type=Path, metavar="OUT.json", help="write everything")
    output.add_argument("--plot", type=Path, metavar="OUT.png", help="timeline (figure 13.1)")
    output.add_argument(
        "--plot-steps", type=int, default=4, help="train steps the timeline shows (default 4)"
    )
    output.add_argument(
        "--repeats",
        type=int,
        help="seeds averaged by --recommend (default 3)",
    )
    sim.set_defaults(func=main)
    return sim


def main(args: argparse.Namespace) -> int:
    """Run `relayrl sim`; a user mistake is a ValueError (one line, exit 2 in relayrl.cli)."""
    _check_flags(args)
    source = _source(args)
    if args.recommend:
        return _recommend(args, source)
    return _simulate(args, source)


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [
        "--" + name.replace("_", "-") for name in names if getattr(args, name) not in (None, False)
    ]


def _check_flags(args: argparse.Namespace) -> None:
    if args.timeout_policy and args.timeout_s is None:
        raise ValueError("--timeout-policy needs --timeout-s")
    if args.failure_policy and args.failure_hazard_per_s is None:
        raise ValueError("--failure-policy needs --failure-hazard-per-s")
    if args.window and not args.durations_from_prometheus:
        raise ValueError("--window needs --durations-from-prometheus")
    if args.model_param and (args.durations_file or args.durations_from_prometheus):
        raise ValueError("--model-param sets the episode model; not with measured durations")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.plot_steps < 1:
        raise ValueError(f"--plot-steps must be >= 1, got {args.plot_steps}")
    if args.repeats is not None and not 1 <= args.repeats <= 100:
        raise ValueError(f"--repeats must be in 1..100, got {args.repeats}")
    if args.repeats is not None and not args.recommend:
        raise ValueError("--repeats goes with --recommend")
    if args.recommend:
        swept = _given(args, ("design", "eta", "drain", "drop_stale"))
        if swept:
            raise ValueError(f"--recommend sweeps eta with and without drop-stale; drop {swept[0]}")
        if args.train_time_s is None:
            raise ValueError("--recommend needs --train-time-s (the trainer's seconds per step)")


def _config(args: argparse.Namespace) -> PipelineConfig:
    from relayrl.sim.pipeline import PipelineConfig

    given: dict[str, Any] = {"failure_seed": args.seed}
    for field, flag in (
        ("n_slots", "slots"),
        ("batch_size", "batch_size"),
        ("train_time_s", "train_time_s"),
        ("sync_time_s", "sync_time_s"),
        ("steps", "steps"),
        ("eta", "eta"),
        ("timeout_s", "timeout_s"),
        ("timeout_policy", "timeout_policy"),
        ("failure_hazard_per_s", "failure_hazard_per_s"),
        ("failure_policy", "failure_policy"),
    ):
        if getattr(args, flag) is not None:
            given[field] = getattr(args, flag)
    if args.drain:
        given["drain"] = True
    if args.drop_stale:
        given["drop_stale"] = True
    if args.no_train_during_sync:
        given["train_during_sync"] = False
    design = args.design or "partial"
    if design == "sync" and args.drain:
        raise ValueError("--drain: --design sync never has a rollout in flight at a sync")
    try:
        if args.recommend:
            return PipelineConfig(**given)
        return PipelineConfig.for_design(design, **given)
    except ValueError as exc:
        raise ValueError(_in_flags(str(exc))) from None


def _in_flags(message: str) -> str:
    """A PipelineConfig message in the command line's words."""
    for field, flag in FLAG_OF_FIELD.items():
        if message.startswith(field + " ") or message.startswith(field + "="):
            return flag + message[len(field) :]
        message = message.replace(f"fixes {field}=", f"fixes {flag} ")
    return message.replace("design ", "--design ", 1)


def _source(args: argparse.Namespace) -> DurationSource:
    from relayrl.sim import sources

    if args.durations_file is not None:
        path = args.durations_file
        return sources.MeasuredSource(sources.parse_durations_file(path), str(path))
    if args.durations_from_prometheus:
        return sources.histogram_from_prometheus(
            args.durations_from_prometheus, args.window or "1h"
        )
    try:
        return sources.ModelSource(sources.model_with(args.model_param or []))
    except ValueError as exc:
        raise ValueError(f"--model-param: {exc}") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        path.write_text(json.dumps(data, indent=1) + "\n")
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None


def _check_writable(*paths: Path | None) -> None:
    """Fail before simulating, not after, when an output cannot be written."""
    for path in paths:
        if path is not None and not path.parent.is_dir():
            raise ValueError(f"cannot write {path}: no directory {path.parent}")


# -- a single simulation -------------------------------------------------------------------
def _simulate(args: argparse.Namespace, source: DurationSource) -> int:
    from relayrl.sim.sources import simulate_source

    config = _config(args)
    _check_writable(args.json, args.plot)
    result = simulate_source(config, source, args.seed)
    for line in result_lines(result, source, args.seed):
        print(line)
    if args.json is not None:
        _write_json(
            args.json,
            {
                "durations": {
                    "source": source.describe(),
                    "seed": args.seed,
                    "notes": source.notes(),
                },
                "result": result.to_json(),
            },
        )
        print(f"wrote {args.json}")
    if args.plot is not None:
        from relayrl.sim.plot import plot_timelines

        title = f"{config.describe()}: the first {min(args.plot_steps, config.steps)} steps"
        plot_timelines([(title, result)], args.plot, args.plot_steps)
        print(f"wrote {args.plot}")
    return 0


def result_lines(result: SimResult, source: DurationSource, seed: int) -> list[str]:
    c = result.config
    failed_dropped = result.num_dropped - result.num_dropped_stale - result.num_dropped_timeout
    lines = [
        f"design               {c.describe()}",
        f"durations            {source.describe()}, seed {seed}",
        *(f"                     note: {note}" for note in source.notes()),
        f"rollouts/hour        {result.rollouts_per_hour:,.0f}  ({result.num_trained} trained in "
        f"{result.makespan_s:,.0f} s, to the end of the last train step; its sync not counted)",
        f"slot utilisation     {result.utilisation:.1%}  (an interrupted rollout's pause counts "
        "as busy)",
        f"staleness (trained)  mean {result.staleness_mean:.2f}, max {result.staleness_max}",
    ]
    most = max(result.staleness_histogram.values())
    for staleness, count in result.staleness_histogram.items():
        bar = "#" * max(1, round(HISTOGRAM_WIDTH * count / most))
        lines.append(f"  {staleness:>3} {count:>7}  {bar}")
    lines += [
        f"mean duration        trained {result.trained_duration_mean_s:.1f} s, launched "
        f"{result.launched_duration_mean_s:.1f} s",
        f"launched             {result.num_launched} ({result.num_in_flight_at_end} still in "
        "flight at the end)",
        f"dropped              {result.num_dropped} (stale {result.num_dropped_stale}, timed out "
        f"{result.num_dropped_timeout}, failed {failed_dropped})",
        f"truncated            {result.num_truncated}",
        f"failed               {result.num_failed} (retries {result.num_retries}; failed attempts "
        f"took {result.retry_cost:.1%} of busy slot time)",
    ]
    return lines


# -- the eta recommendation ----------------------------------------------------------------
def _recommend(args: argparse.Namespace, source: DurationSource) -> int:
    from relayrl.sim.recommend import format_sweep, sweep

    base = _config(args)
    _check_writable(args.json, args.plot)
    repeats = args.repeats or 3
    print(f"relayrl sim --recommend: {base.describe().split(', ', 1)[1]}")
    print(f"durations: {source.describe()}")
    for note in source.notes():
        print(f"note: {note}")
    result = sweep(base, source, list(range(args.seed, args.seed + repeats)))
    for line in format_sweep(result):
        print(line)
    if args.json is not None:
        _write_json(args.json, {"durations": source.describe(), **result.to_json()})
        print(f"wrote {args.json}")
    if args.plot is not None:
        from relayrl.sim.plot import plot_sweep

        plot_sweep(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
