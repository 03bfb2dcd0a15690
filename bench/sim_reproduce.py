"""`make bench-sim-reproduce`: the reference figures for relayrl's rollout pipeline simulator
(docs/simulation.md#reference-figures), recomputed with `relayrl.sim` side by side.

    python bench/sim_reproduce.py [--repeats 5] [--seed 0] [--json OUT.json] [--plot OUT.png]

The seed's configuration: 64 slots, 64 rollouts per step, train 60 s, sync 10 s, 20 steps,
durations from the episode model (EpisodeModel() defaults). The seed reports one 20-step run;
20 steps are noisy (one step's length is the slowest of 64 rollouts), so every figure here is
the mean over several duration seeds, each design seeing the same rollouts within a seed.
Nothing is fitted: the only inputs are the seed's configuration and the duration model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from relayrl.sim.durations import EpisodeModel
from relayrl.sim.pipeline import FAILED, RUNNING, PipelineConfig, SimResult
from relayrl.sim.sources import ModelSource, simulate_source

TOLERANCE = 0.15
SEED_CONFIG = PipelineConfig(
    n_slots=64, batch_size=64, train_time_s=60.0, sync_time_s=10.0, steps=20, eta=0
)
FAILURE_HAZARD_PER_S = 1 / 2000
FAILURE_STEPS = 100
"""The failure figures use longer runs: their longest decile then holds ~3,000 rollouts."""


@dataclass(frozen=True)
class Figure:
    name: str
    seed_value: float
    per_run: tuple[float, ...]  # ours, one per duration seed
    unit: str  # "/h", "%", "x", "s" or "" (a plain number)
    why: str  # printed when ours is outside the tolerance

    @property
    def ours(self) -> float:
        return float(np.mean(self.per_run))

    @property
    def ratio(self) -> float:
        return self.ours / self.seed_value

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE

    def show(self, value: float) -> str:
        if self.unit == "/h":
            return f"{value:,.0f}/h"
        if self.unit == "%":
            return f"{value:.1%}"
        if self.unit == "x":
            return f"{value:.2f}x"
        if self.unit == "s":
            return f"{value:.1f} s"
        return f"{value:.2f}"


@dataclass(frozen=True)
class Reproduction:
    seeds: tuple[int, ...]
    figures: tuple[Figure, ...]
    notes: tuple[str, ...]


class _Runs:
    """Each (design, changes) simulated once per seed, cached."""

    def __init__(self, seeds: tuple[int, ...], model: EpisodeModel) -> None:
        self.seeds, self.source = seeds, ModelSource(model)
        self.cache: dict[tuple, list[SimResult]] = {}

    def __call__(self, **changes) -> list[SimResult]:
        key = tuple(sorted(changes.items()))
        if key not in self.cache:
            self.cache[key] = [
                simulate_source(
                    replace(SEED_CONFIG, failure_seed=seed, **changes), self.source, seed
                )
                for seed in self.seeds
            ]
        return self.cache[key]


def _per_run(runs: list[SimResult], of: Callable[[SimResult], float]) -> tuple[float, ...]:
    return tuple(float(of(r)) for r in runs)


def _ratio(a: list[SimResult], b: list[SimResult]) -> tuple[float, ...]:
    """Per seed: a's throughput / b's (the same rollouts)."""
    return tuple(x.rollouts_per_hour / y.rollouts_per_hour for x, y in zip(a, b, strict=True))


def _loss(cheap: list[SimResult], dear: list[SimResult]) -> tuple[float, ...]:
    return tuple(1.0 - r for r in _ratio(dear, cheap))


def reproduce(
    num_seeds: int = 5, first_seed: int = 0, model: EpisodeModel | None = None
) -> Reproduction:
    if num_seeds < 1:
        raise ValueError(f"--repeats must be >= 1, got {num_seeds}")
    model = model or EpisodeModel()
    seeds = tuple(range(first_seed, first_seed + num_seeds))
    run = _Runs(seeds, model)
    return Reproduction(
        seeds,
        tuple(_design_figures(run) + _sync_cost_figures(run) + _timeout_figures(run, model))
        + tuple(_failure_figures(run)),
        _notes(run),
    )


def _design_figures(run: _Runs) -> list[Figure]:
    # Drain designs: the drained sync ends the step, so the trainer waits for it (see
    # DRAIN_NOTE); the literal reading is still computed, to print next to it.
    sync, drain1 = run(eta=0), run(eta=1, drain=True, train_during_sync=False)
    p1, p2 = run(eta=1), run(eta=2)
    drain4 = run(eta=4, drain=True, train_during_sync=False)
    noise = "the seed reports one 20-step run, whose length is set by 20 batch maxima"
    tput = lambda r: r.rollouts_per_hour  # noqa: E731
    busy = lambda r: r.utilisation  # noqa: E731
    return [
        Figure("sync: rollouts/hour", 451, _per_run(sync, tput), "/h", noise),
        Figure("sync: slots busy", 0.19, _per_run(sync, busy), "%", noise),
        Figure("one-step-off + drain: x sync", 1.12, _ratio(drain1, sync), "x", noise),
        Figure("partial eta=1: x sync", 4.1, _ratio(p1, sync), "x", noise),
        Figure("partial eta=1: slots busy", 0.81, _per_run(p1, busy), "%", noise),
        Figure("partial eta=2: x sync", 4.6, _ratio(p2, sync), "x", noise),
        Figure("partial eta=2: slots busy", 0.95, _per_run(p2, busy), "%", noise),
        Figure("eta=4 + drain: x sync", 1.0, _ratio(drain4, sync), "x", noise),
        Figure(
            "partial eta=1: staleness mean",
            1.0,
            _per_run(p1, lambda r: r.staleness_mean),
            "",
            noise,
        ),
        Figure(
            "partial eta=2: staleness mean",
            1.5,
            _per_run(p2, lambda r: r.staleness_mean),
            "",
            noise,
        ),
        Figure(
            "partial eta=1: staleness max",
            5,
            _per_run(p1, lambda r: r.staleness_max),
            "",
            "a maximum is one straggler; " + noise,
        ),
        Figure(
            "partial eta=2: staleness max",
            7,
            _per_run(p2, lambda r: r.staleness_max),
            "",
            "a maximum is one straggler; " + noise,
        ),
        Figure(
            "sync: mean trained duration",
            98,
            _per_run(sync, lambda r: r.trained_duration_mean_s),
            "s",
            "the mean of 1,280 draws of our duration model",
        ),
        Figure(
            "partial eta=1: mean trained duration",
            93.5,
            _per_run(p1, lambda r: r.trained_duration_mean_s),
            "s",
            noise,
        ),
        Figure(
            "partial eta=2: mean trained duration",
            93.5,
            _per_run(p2, lambda r: r.trained_duration_mean_s),
            "s",
            noise,
        ),
    ]


def _sync_cost_figures(run: _Runs) -> list[Figure]:
    loss = {
        eta: _loss(run(eta=eta, sync_time_s=1.0), run(eta=eta, sync_time_s=60.0))
        for eta in (0, 1, 2)
    }
    eta1 = float(np.mean(loss[1]))
    return [
        Figure(
            "sync 1 s -> 60 s: sync design loses",
            0.11,
            loss[0],
            "%",
            "the seed reports one 20-step run per sync cost",
        ),
        Figure(
            f"sync 1 s -> 60 s: async (partial eta=2) loses (eta=1: {eta1:.0%})",
            0.37,
            loss[2],
            "%",
            "the seed does not say which eta; eta=1 loses "
            f"{eta1:.1%}, and the seed reports one 20-step run per sync cost",
        ),
    ]


def _timeout_figures(run: _Runs, model: EpisodeModel) -> list[Figure]:
    sync, p1 = run(eta=0), run(eta=1)
    p95 = float(np.quantile(model.durations(run.seeds[0], 200_000), 0.95))
    cut = run(eta=0, timeout_s=round(p95, 1))
    tput = lambda r: r.rollouts_per_hour  # noqa: E731
    return [
        Figure("13.7: duration p95", 279, (p95,), "s", "a property of our duration model"),
        Figure(
            "13.7: sync, timeout at p95: rollouts/hour",
            661,
            _per_run(cut, tput),
            "/h",
            "the seed reports one 20-step run",
        ),
        Figure("13.7: sync, timeout at p95: x sync", 661 / 451, _ratio(cut, sync), "x", "one run"),
        Figure(
            "13.7: partial eta=1 / sync with timeout",
            3.0,
            _ratio(p1, cut),
            "x",
            "the seed's '3x' is a rounded figure",
        ),
    ]


def _failure_figures(run: _Runs) -> list[Figure]:
    runs = run(eta=0, steps=FAILURE_STEPS, failure_hazard_per_s=FAILURE_HAZARD_PER_S)
    all_rate, decile_rate, all_mean, survivor_mean = [], [], [], []
    for r in runs:
        spans = [s for s in r.timeline.rollouts if s.ended != RUNNING]
        durations = np.array([s.duration_s for s in spans])
        failed = np.array([s.ended == FAILED for s in spans])
        longest = durations >= np.quantile(durations, 0.9)
        all_rate.append(failed.mean())
        decile_rate.append(failed[longest].mean())
        all_mean.append(durations.mean())
        survivor_mean.append(durations[~failed].mean())
    why = "failures are random: a few hundred per run"
    return [
        Figure("failures 1/2000 s: share of all rollouts", 0.045, tuple(all_rate), "%", why),
        Figure("failures: share of the longest decile", 0.136, tuple(decile_rate), "%", why),
        Figure(
            "failures: longest decile / all",
            0.136 / 0.045,
            tuple(d / a for d, a in zip(decile_rate, all_rate, strict=True)),
            "x",
            why,
        ),
        Figure("failures: mean duration, all rollouts", 96, tuple(all_mean), "s", why),
        Figure("failures: mean duration, survivors", 92, tuple(survivor_mean), "s", why),
    ]


def _notes(run: _Runs) -> tuple[str, ...]:
    n = len(run.seeds)
    sync, literal = run(eta=0), run(eta=4, drain=True)
    literal_x = float(np.mean(_ratio(literal, sync)))
    return (
        "drain designs: the trainer waits for each drained sync before its next step (the "
        "seed's 'eta=4 with drain is as slow as sync, each sync still waits for the longest "
        "in-flight rollout' holds only then); read literally, the seed's loop lets an idle "
        "trainer keep training while a requested sync waits for the drain, and eta=4 + drain "
        f"then gives {literal_x:.2f}x sync",
        f"each figure is the mean over {n} runs (duration seeds {run.seeds[0]}..{run.seeds[-1]}; "
        "within a seed every design sees the same rollouts); 'runs' is their range",
        "ratios to sync ('x sync', 'loses') are paired per seed, then averaged; the seed's "
        "'+12%' is compared as the ratio 1.12x (a gain of a few percent has no useful +-15%)",
        "staleness max: the mean over runs of each run's maximum",
        f"failure rows: sync design, {FAILURE_STEPS} steps per run, hazard 1/2000 s, failed "
        "rollouts dropped; every launched rollout has ended, so none is censored",
        "the seed's 'async' in the sync-cost figure is taken as partial eta=2: its reason "
        "(sync pauses dominate once straggler waits are gone) is the generation-bound regime "
        "eta=2 reaches",
        "makespans end with the last train step; the sync after it is not counted",
    )


def format_table(rep: Reproduction) -> list[str]:
    figures = rep.figures
    width = max(len(f.name) for f in figures)
    lines = [
        f"{'figure':<{width}}  {'seed':>9}  {'ours':>9}  {'ratio':>5}  +-15%  runs",
    ]
    for f in figures:
        low, high = min(f.per_run), max(f.per_run)
        spread = f.show(low) if low == high else f"{f.show(low)} .. {f.show(high)}"
        lines.append(
            f"{f.name:<{width}}  {f.show(f.seed_value):>9}  {f.show(f.ours):>9}  "
            f"{f.ratio:>5.2f}  {'yes' if f.within else 'NO ':<4}  {spread}"
        )
    outside = [f for f in figures if not f.within]
    if outside:
        lines.append("")
        lines.append("outside +-15%:")
        for f in outside:
            inside = min(f.per_run) <= f.seed_value <= max(f.per_run)
            lines.append(
                f"  {f.name}: {f.why}" + ("; the seed's value is within our runs" if inside else "")
            )
    lines.append("")
    lines.extend(f"note: {note}" for note in rep.notes)
    return lines


def plot_figure_13_1(path: Path, seed: int, steps: int) -> None:
    """The seed's figure 13.1: 8 slots, 8 rollouts per step, sync above partial eta=1."""
    from relayrl.sim.plot import plot_timelines, plot_until_s

    small = replace(SEED_CONFIG, n_slots=8, batch_size=8, steps=max(steps, 1))
    source = ModelSource(EpisodeModel())
    sync = simulate_source(replace(small, eta=0), source, seed)
    partial = simulate_source(replace(small, eta=1), source, seed)
    plot_timelines(
        [("sync (8 slots, 8 rollouts/step)", sync), ("partial rollout, eta=1", partial)],
        path,
        steps,
    )
    print(
        f"wrote {path}: {steps} steps take {plot_until_s(sync, steps):,.0f} s (sync) and "
        f"{plot_until_s(partial, steps):,.0f} s (partial eta=1) with seed {seed}; the seed's "
        "figure 13.1 (one sample): 1,130 s and 493 s for four steps"
    )


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sim_reproduce",
        description="The source's figures for the rollout pipeline simulator, side by side with "
        "relayrl.sim's (docs/simulation.md#reference-figures).",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="first durations seed (default 0)")
    parser.add_argument("--json", type=Path, metavar="OUT.json", help="write every figure")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="figure 13.1's timelines")
    parser.add_argument(
        "--plot-steps", type=int, default=4, help="train steps the timeline shows (default 4)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= 100:
        parser.error(f"--repeats must be in 1..100, got {args.repeats}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.plot_steps < 1:
        parser.error(f"--plot-steps must be >= 1, got {args.plot_steps}")
    for path in (args.json, args.plot):
        if path is not None and not path.parent.is_dir():
            parser.error(f"cannot write {path}: no directory {path.parent}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    rep = reproduce(num_seeds=args.repeats, first_seed=args.seed)
    print(
        "sim-reproduce: the reference configuration "
        "(docs/simulation.md#reference-figures) "
        f"({SEED_CONFIG.n_slots} slots, {SEED_CONFIG.batch_size} rollouts/step, train "
        f"{SEED_CONFIG.train_time_s:g} s, sync {SEED_CONFIG.sync_time_s:g} s, "
        f"{SEED_CONFIG.steps} steps), durations from EpisodeModel(), {args.repeats} runs per "
        "figure"
    )
    print()
    for line in format_table(rep):
        print(line)
    if args.json is not None:
        figures = [
            {
                "figure": f.name,
                "seed": f.seed_value,
                "ours": f.ours,
                "ratio": f.ratio,
                "within_15_percent": f.within,
                "per_run": list(f.per_run),
                "why_if_outside": f.why,
            }
            for f in rep.figures
        ]
        data = {"seeds": list(rep.seeds), "figures": figures, "notes": list(rep.notes)}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot_figure_13_1(args.plot, args.seed, args.plot_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
