"""Pictures of simulated pipelines: the timeline of docs/simulation.md#model (one bar per
rollout per slot, coloured by the version that launched it, train steps and syncs marked) and
the sweep of throughput and staleness against eta. matplotlib's object API on an Agg canvas:
no pyplot state, no display needed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from relayrl.sim.pipeline import FAILED, RUNNING, TIMED_OUT, SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from relayrl.sim.recommend import Sweep

TRAIN_COLOUR = "mediumaquamarine"
SYNC_COLOUR = "gold"


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: Path) -> None:
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None


def plot_until_s(result: SimResult, steps: int) -> float:
    """When the first `steps` train steps have ended (the whole run if it has fewer)."""
    spans = result.timeline.train_steps
    return spans[min(steps, len(spans)) - 1].end_s


def _timeline(ax: Axes, title: str, result: SimResult, until_s: float) -> None:
    from matplotlib import colormaps

    timeline = result.timeline
    colours = colormaps["tab10"]
    label_bars = timeline.n_slots <= 16
    for span in timeline.rollouts:
        if span.start_s >= until_s:
            continue
        end = min(span.end_s, until_s)
        hatch = "xx" if span.ended == FAILED else "//" if span.ended == TIMED_OUT else None
        ax.barh(
            span.slot,
            end - span.start_s,
            left=span.start_s,
            height=0.8,
            color=colours(span.version % 10),
            alpha=0.5 if span.ended == RUNNING or span.dropped_stale else 0.9,
            edgecolor="black" if label_bars else "white",  # consecutive rollouts stay apart
            linewidth=0.4,
            hatch=hatch,
        )
        if label_bars and end - span.start_s > until_s / 40:
            ax.text(
                (span.start_s + end) / 2,
                span.slot,
                str(span.version),
                ha="center",
                va="center",
                fontsize=7,
            )
    trainer_row = timeline.n_slots + 0.5
    for step in timeline.train_steps:
        if step.start_s < until_s:
            width = min(step.end_s, until_s) - step.start_s
            ax.barh(trainer_row, width, left=step.start_s, height=1.2, color=TRAIN_COLOUR)
            ax.text(
                step.start_s + width / 2,
                trainer_row,
                f"train {step.step}",
                ha="center",
                va="center",
                fontsize=7,
            )
    for sync in timeline.syncs:
        if sync.start_s < until_s:
            ax.axvspan(
                sync.start_s, min(sync.end_s, until_s), color=SYNC_COLOUR, alpha=0.35, linewidth=0
            )
    from matplotlib.patches import Patch

    versions = sorted({s.version for s in timeline.rollouts if s.start_s < until_s})
    handles = [Patch(color=colours(v % 10), label=f"v{v}") for v in versions[:10]]
    handles += [Patch(color=TRAIN_COLOUR, label="train"), Patch(color=SYNC_COLOUR, label="sync")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_xlim(0, until_s)
    ax.set_ylim(-0.8, trainer_row + 1)
    ax.set_ylabel("slot")
    ax.set_title(title, fontsize=9, loc="left")


def plot_timelines(panels: Sequence[tuple[str, SimResult]], path: Path, steps: int) -> None:
    """One timeline panel per (title, result), each up to the end of its `steps`-th step."""
    slots = max(result.timeline.n_slots for _, result in panels)
    height = min(3.0 + slots * 0.12, 9.0) * len(panels)
    figure = _figure(11, min(height, 16))
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, result) in zip(axes, panels, strict=True):
        _timeline(ax, title, result, plot_until_s(result, steps))
    axes[-1].set_xlabel(
        "simulated seconds (bar colour: launching version; hatched: failed / timed out; "
        "faded: still running at the end or dropped stale)"
    )
    _save(figure, path)


def plot_sweep(sweep: Sweep, path: Path) -> None:
    """Figure 13.2: rollouts/hour against eta (partial, partial + drop-stale, the bound) and
    the staleness of trained rollouts."""
    etas = [row.eta for row in sweep.rows]
    figure = _figure(11, 4)
    left, right = figure.subplots(1, 2)
    left.plot(etas, [r.partial.rollouts_per_hour for r in sweep.rows], "o-", label="partial")
    left.plot(
        etas, [r.drop_stale.rollouts_per_hour for r in sweep.rows], "s--", label="+ drop-stale"
    )
    left.axhline(sweep.bound.rollouts_per_hour, color="grey", linestyle=":", label="bound")
    left.set_xlabel("eta")
    left.set_ylabel("trained rollouts / hour")
    left.legend()
    right.plot(etas, [r.partial.staleness_mean for r in sweep.rows], "o-", label="mean")
    right.plot(etas, [r.partial.staleness_max for r in sweep.rows], "^-", label="max")
    right.plot(etas, etas, color="grey", linestyle=":", label="eta")
    right.set_xlabel("eta")
    right.set_ylabel("staleness of trained rollouts (partial)")
    right.legend()
    _save(figure, path)
