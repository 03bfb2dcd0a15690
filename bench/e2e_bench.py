"""The main job, synchronous vs asynchronous, placed as on a cluster: `relayrl up` on the
default task for the same number of steps in `sync` and in `separate_async` (eta 1), one after
the other in one run, from the same (cached) warm start, with the engine and the trainer on
disjoint CPU sets (`placement`; the same sets in both modes), so that overlapping rollout and
training can buy what separate accelerators buy. `--no-placement` lets them share every CPU
(the shape of a single box, where overlap adds no compute).

Throughput is trained trajectories per hour of training: the trajectories of the groups the
trainer trained on, over the time from the trainer's start to its last step (model build,
warm start, engine start and the final evaluation are outside it; both modes pay them alike).
The gain is the held-out accuracy (greedy, the run's held-out set) at the end minus the warm
start's, in points. Accuracy at equal time compares the two runs at the training time of the
faster one: its final accuracy against the slower run's latest evaluation by then (every
`--eval-every` steps). Where the time goes is printed per phase of a step for both modes.

The last line is exactly:
    e2e-bench: async/sync=<trajectories per hour ratio> gain=<points gained in the async run>
    acc_at_equal_time=<async - sync, points>
(on one line).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from up_runs import UpRun, default_placement, run_up

MODES = (("sync", 0), ("separate_async", 1))
# The additive phases of a step (the trainer's `model` phase is the compute inside the two
# middle ones); what is left of the step is `other`: sampling, batching, metrics.
PHASES = ("wait", "old_logprobs", "update", "publish")


@dataclass
class Result:
    mode: str
    eta: int
    run: UpRun
    steps: int
    trajectories: int
    train_s: float
    warm: float
    final: float
    staleness_mean: float
    phases: dict[str, float]  # mean seconds per step
    curve: list[tuple[float, float]]  # (training seconds when the evaluated step ended, accuracy)
    placed: dict[str, str]  # child -> the CPUs it ran on

    @property
    def per_hour(self) -> float:
        return self.trajectories / self.train_s * 3600

    @property
    def gain_points(self) -> float:
        return (self.final - self.warm) * 100

    def accuracy_at(self, seconds: float) -> float:
        """The latest evaluation of a step that had ended `seconds` into training."""
        return max((c for c in self.curve if c[0] <= seconds + 1e-6), default=(0.0, self.warm))[1]


def cpus_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def watch_placement(placed: dict[str, str]):
    """A `run_up` watcher: records the CPUs each child of the stack is allowed, once the
    trainer runs (read from /proc, not from the config: what the kernel enforces)."""
    from relayrl.up.stack_state import StackState

    def watch(run_dir: Path) -> bool:
        try:
            children = StackState.read(run_dir).children
            pids = {name: child.pid for name, child in children.items()}
            if pids.get("trainer") is None or None in pids.values():
                return False  # not every child runs yet
            placed.update({name: cpus_of(pid) for name, pid in pids.items() if pid is not None})
        except (OSError, ValueError):
            return False
        return True

    return watch


def run(mode: str, eta: int, args: argparse.Namespace, runs_dir: Path) -> Result:
    config: dict = {
        "train": {"mode": mode, "eta": eta, "steps": args.steps},
        "eval": {"interval_steps": args.eval_every, "sampled": False},
    }
    if args.placement:
        config["placement"] = args.placement
    placed: dict[str, str] = {}
    run = run_up(mode, config, runs_dir, bench="e2e-bench", watch=watch_placement(placed))
    records = run.steps
    state = run.state
    n = run.config["train"]["samples_per_prompt"]
    started = state.training_started
    ended = {r.step + 1: r.time - started for r in records}  # steps done -> seconds
    curve = [
        (ended[e.step], e.accuracy)
        for e in run.evals
        if e.kind in ("periodic", "final") and e.step in ended and e.accuracy is not None
    ]
    return Result(
        mode=mode,
        eta=eta,
        run=run,
        steps=len(records),
        trajectories=sum(r.groups.get("keep", 0) for r in records) * n,
        train_s=run.train_s,
        warm=run.accuracy("warm_start"),
        final=run.accuracy("final"),
        staleness_mean=statistics.fmean(r.staleness_mean or 0.0 for r in records),
        phases={p: statistics.fmean(r.phases_s.get(p, 0.0) for r in records) for p in PHASES},
        curve=curve,
        placed=placed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per mode")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out evaluation interval")
    parser.add_argument("--no-placement", action="store_true", help="let every part use every CPU")
    parser.add_argument("--runs-dir", type=Path, help="default: a temporary folder")
    args = parser.parse_args()
    args.placement = None if args.no_placement else default_placement()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="e2e-bench-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(f"e2e-bench: placement {args.placement or 'none'}; runs in {runs_dir}", file=sys.stderr)
    results = [run(mode, eta, args, runs_dir) for mode, eta in MODES]
    print(
        f"{'mode':<15} {'eta':>3} {'steps':>5} {'trajs':>6} {'train s':>8} {'trajs/h':>9} "
        f"{'staleness':>9} {'warm':>6} {'final':>6} {'gain':>6}"
    )
    for r in results:
        print(
            f"{r.mode:<15} {r.eta:>3} {r.steps:>5} {r.trajectories:>6} {r.train_s:>8.1f} "
            f"{r.per_hour:>9.0f} {r.staleness_mean:>9.2f} {r.warm:>6.1%} {r.final:>6.1%} "
            f"{r.gain_points:>+6.1f}"
        )
    print("seconds per step, by phase (wait: for scored groups, i.e. rollout and reward):")
    print(f"{'mode':<15} " + " ".join(f"{p:>12}" for p in (*PHASES, "other", "step")))
    for r in results:
        step_s = r.train_s / max(r.steps, 1)
        other = step_s - sum(r.phases.values())
        print(
            f"{r.mode:<15} " + " ".join(f"{v:>12.2f}" for v in (*r.phases.values(), other, step_s))
        )
    for r in results:
        print(f"{r.mode:<15} CPUs: " + ", ".join(f"{k}={v}" for k, v in sorted(r.placed.items())))
    sync, async_ = results
    ratio = async_.per_hour / sync.per_hour
    equal = min(sync.train_s, async_.train_s)
    gap = (async_.accuracy_at(equal) - sync.accuracy_at(equal)) * 100
    print(
        f"at {equal:.0f} s of training: sync {sync.accuracy_at(equal):.1%}, "
        f"async {async_.accuracy_at(equal):.1%}"
    )
    print(
        f"e2e-bench: async/sync={ratio:.2f} gain={async_.gain_points:.1f} "
        f"acc_at_equal_time={gap:.1f}"
    )


if __name__ == "__main__":
    main()
