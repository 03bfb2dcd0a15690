"""`relayrl sim --recommend`: the smallest staleness bound eta that gets most of the pipeline's
throughput (docs/simulation.md#reference-figures: most of async's gain comes at eta 1 or 2).

The bound a design is measured against:

    generation  n_slots / mean duration * 3600 rollouts/hour while generating; every train
                step costs one sync that pauses all slots, so per batch_size trained rollouts the
                slots spend batch_size * mean / n_slots seconds generating and sync_time_s
                paused:  3600 * batch_size / (batch_size * mean / n_slots + sync_time_s)
    trainer     3600 * batch_size / train_time_s (plus sync_time_s when the trainer waits for
                its syncs)

and the bound is the smaller of the two. eta is swept 0..8 with partial (interruptible) syncs,
once as is and once with the trainer dropping rollouts staler than eta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from relayrl.sim.pipeline import PipelineConfig, SimResult
from relayrl.sim.sources import DurationSource, simulate_source

TARGET_SHARE = 0.9
ETAS = tuple(range(9))


@dataclass(frozen=True)
class Bound:
    mean_duration_s: float
    raw_generation_per_hour: float
    """n_slots / mean duration * 3600: every slot always generating."""
    sync_share: float
    """Share of time the slots are paused by syncs at that rate."""
    generation_per_hour: float
    trainer_per_hour: float

    @property
    def rollouts_per_hour(self) -> float:
        return min(self.generation_per_hour, self.trainer_per_hour)

    @property
    def binding(self) -> str:
        return "generation" if self.generation_per_hour <= self.trainer_per_hour else "trainer"


def capacity_bound(config: PipelineConfig, mean_duration_s: float) -> Bound:
    generating_s = config.batch_size * mean_duration_s / config.n_slots
    step_s = config.train_time_s + (0.0 if config.train_during_sync else config.sync_time_s)
    return Bound(
        mean_duration_s=mean_duration_s,
        raw_generation_per_hour=config.n_slots / mean_duration_s * 3600.0,
        sync_share=config.sync_time_s / (generating_s + config.sync_time_s),
        generation_per_hour=3600.0 * config.batch_size / (generating_s + config.sync_time_s),
        trainer_per_hour=3600.0 * config.batch_size / step_s,
    )


@dataclass(frozen=True)
class Point:
    """One configuration, over the repeats."""

    rollouts_per_hour: float  # mean
    utilisation: float  # mean
    staleness_mean: float  # mean
    staleness_max: int  # the largest over the repeats
    dropped_share: float  # dropped / launched, mean

    @classmethod
    def of(cls, runs: Sequence[SimResult]) -> Point:
        return cls(
            rollouts_per_hour=float(np.mean([r.rollouts_per_hour for r in runs])),
            utilisation=float(np.mean([r.utilisation for r in runs])),
            staleness_mean=float(np.mean([r.staleness_mean for r in runs])),
            staleness_max=max(r.staleness_max for r in runs),
            dropped_share=float(np.mean([r.num_dropped / r.num_launched for r in runs])),
        )


@dataclass(frozen=True)
class SweepRow:
    eta: int
    partial: Point
    drop_stale: Point


@dataclass(frozen=True)
class Sweep:
    config: PipelineConfig  # the base (eta, drain and drop_stale are swept)
    bound: Bound
    seeds: tuple[int, ...]
    rows: tuple[SweepRow, ...]

    def smallest(self, column: str) -> SweepRow | None:
        """The smallest eta whose `column` ('partial' or 'drop_stale') reaches the target."""
        target = TARGET_SHARE * self.bound.rollouts_per_hour
        for row in self.rows:
            if getattr(row, column).rollouts_per_hour >= target:
                return row
        return None

    def best(self, column: str) -> SweepRow:
        return max(self.rows, key=lambda row: getattr(row, column).rollouts_per_hour)

    def to_json(self) -> dict[str, Any]:
        bound = self.bound
        return {
            "config": {k: v for k, v in asdict(self.config).items() if k not in ("eta", "drain")},
            "seeds": list(self.seeds),
            "target_share": TARGET_SHARE,
            "bound": {
                **vars(bound),
                "rollouts_per_hour": bound.rollouts_per_hour,
                "binding": bound.binding,
            },
            "rows": [
                {"eta": row.eta, "partial": vars(row.partial), "drop_stale": vars(row.drop_stale)}
                for row in self.rows
            ],
            "recommended_eta": {
                column: (row.eta if (row := self.smallest(column)) else None)
                for column in ("partial", "drop_stale")
            },
        }


def sweep(
    base: PipelineConfig,
    source: DurationSource,
    seeds: Sequence[int],
    etas: Sequence[int] = ETAS,
) -> Sweep:
    sample = source.durations(50_000, seeds[0])
    if base.timeout_s is not None:
        sample = np.minimum(sample, base.timeout_s)
    bound = capacity_bound(base, float(sample.mean()))
    rows = []
    for eta in etas:
        columns = []
        for drop_stale in (False, True):
            config = replace(base, eta=eta, drain=False, drop_stale=drop_stale)
            runs = [
                simulate_source(replace(config, failure_seed=seed), source, seed) for seed in seeds
            ]
            columns.append(Point.of(runs))
        rows.append(SweepRow(eta, columns[0], columns[1]))
    return Sweep(base, bound, tuple(seeds), tuple(rows))


def format_sweep(result: Sweep) -> list[str]:
    bound, target = result.bound, TARGET_SHARE * result.bound.rollouts_per_hour
    c = result.config
    lines = [
        f"bound: generation {bound.generation_per_hour:,.0f}/h = {c.n_slots} slots / "
        f"{bound.mean_duration_s:.1f} s mean duration * 3600 ({bound.raw_generation_per_hour:,.0f}"
        f"/h) less the syncs' pauses ({bound.sync_share:.1%}: {c.sync_time_s:g} s per "
        f"{c.batch_size} rollouts); trainer {bound.trainer_per_hour:,.0f}/h "
        f"({c.batch_size} rollouts per {c.train_time_s:g} s step"
        + ("" if c.train_during_sync else f" + {c.sync_time_s:g} s sync")
        + ")",
        f"the bound is {bound.rollouts_per_hour:,.0f}/h ({bound.binding}); target "
        f"{TARGET_SHARE:.0%} of it = {target:,.0f}/h",
        f"each cell: mean over {len(result.seeds)} runs of {c.steps} steps "
        f"(seeds {result.seeds[0]}..{result.seeds[-1]}); max staleness: the largest of them",
        "",
        f"{'':>3}  {'partial':^39}  {'partial + drop-stale':^39}",
        f"{'eta':>3}  {'rollouts/h':>10} {'bound':>6} {'stale mean':>10} {'max':>4}    "
        f"{'rollouts/h':>10} {'bound':>6} {'dropped':>8} {'max':>4}",
    ]
    for row in result.rows:
        p, d = row.partial, row.drop_stale
        share_p = p.rollouts_per_hour / bound.rollouts_per_hour
        share_d = d.rollouts_per_hour / bound.rollouts_per_hour
        lines.append(
            f"{row.eta:>3}  {p.rollouts_per_hour:>10,.0f} {share_p:>6.0%} "
            f"{p.staleness_mean:>10.2f} {p.staleness_max:>4}    "
            f"{d.rollouts_per_hour:>10,.0f} {share_d:>6.0%} "
            f"{d.dropped_share:>8.1%} {d.staleness_max:>4}"
        )
    lines.append("")
    for column, label in (("partial", "partial"), ("drop_stale", "partial + drop-stale")):
        lines.append(_recommendation(result, column, label))
    return lines


def _recommendation(result: Sweep, column: str, label: str) -> str:
    bound = result.bound.rollouts_per_hour
    row = result.smallest(column)
    if row is None:
        best = result.best(column)
        point = getattr(best, column)
        return (
            f"{label}: no eta in {result.rows[0].eta}..{result.rows[-1].eta} reaches "
            f"{TARGET_SHARE:.0%} of the bound; the best is eta={best.eta} at "
            f"{point.rollouts_per_hour:,.0f}/h ({point.rollouts_per_hour / bound:.0%}), staleness "
            f"mean {point.staleness_mean:.2f}, max {point.staleness_max}"
        )
    point = getattr(row, column)
    extra = (
        f", {point.dropped_share:.1%} of launched rollouts dropped"
        if column == "drop_stale"
        else ""
    )
    return (
        f"{label}: eta={row.eta} is the smallest to reach {TARGET_SHARE:.0%} of the bound: "
        f"{point.rollouts_per_hour:,.0f}/h ({point.rollouts_per_hour / bound:.0%}), costing "
        f"staleness mean {point.staleness_mean:.2f}, max {point.staleness_max}{extra}"
    )
