"""The main job, synchronous vs asynchronous: `relayrl up` on the default task for the same
number of steps in `sync` and in `separate_async` (eta 1), one after the other in one run,
from the same (cached) warm start.

Throughput is trained trajectories per hour of training: the trajectories of the groups the
trainer trained on, over the time from the trainer's start to its last step (model build,
warm start, engine start and evaluations are outside it; both modes pay them alike). The gain
is the held-out accuracy (greedy, the run's held-out set) at the end minus the warm start's,
in points.

The last line is exactly:
    e2e-bench: async/sync=<trajectories per hour ratio> gain=<points gained in the async run>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

MODES = (("sync", 0), ("separate_async", 1))


@dataclass
class Result:
    mode: str
    eta: int
    steps: int
    trajectories: int
    train_s: float
    warm: float
    final: float
    staleness_mean: float

    @property
    def per_hour(self) -> float:
        return self.trajectories / self.train_s * 3600

    @property
    def gain_points(self) -> float:
        return (self.final - self.warm) * 100


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run(mode: str, eta: int, args: argparse.Namespace, runs_dir: Path) -> Result:
    argv = [
        str(Path(sys.executable).parent / "relayrl"), "up",
        "--mode", mode, "--eta", str(eta), "--steps", str(args.steps),
        "--runs-dir", str(runs_dir),
        *(["--config", str(args.config)] if args.config else []),
    ]  # fmt: skip
    started = time.monotonic()
    log_path = runs_dir / f"{mode}.log"
    with log_path.open("wb") as log:
        code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
    output = log_path.read_text(errors="replace")
    if code != 0:
        sys.exit(f"e2e-bench: relayrl up --mode {mode} exited {code}:\n{output[-3000:]}")
    run_dir = Path(
        next(x for x in output.splitlines() if x.startswith("relayrl up: run ")).rsplit(" ", 1)[-1]
    )
    state = json.loads((run_dir / "run.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    records = {r["step"]: r for r in read_jsonl(run_dir / "trainer" / "steps.jsonl")}
    n = config["train"]["samples_per_prompt"]
    evals = read_jsonl(run_dir / "eval.jsonl")
    warm = next(e for e in evals if e["kind"] == "warm_start")
    final = next(e for e in reversed(evals) if e["kind"] == "final")
    print(
        f"  {mode:<15} done in {time.monotonic() - started:.0f} s ({run_dir})",
        file=sys.stderr,
    )
    return Result(
        mode=mode,
        eta=eta,
        steps=len(records),
        trajectories=sum(r["groups"].get("keep", 0) for r in records.values()) * n,
        train_s=state["training_finished"] - state["training_started"],
        warm=warm["accuracy"],
        final=final["accuracy"],
        staleness_mean=sum(r.get("staleness_mean", 0) for r in records.values()) / len(records),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per mode")
    parser.add_argument("--config", type=Path, help="relayrl up config (default: built-in)")
    parser.add_argument("--runs-dir", type=Path, help="default: a temporary folder")
    args = parser.parse_args()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="e2e-bench-"))
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
    sync, async_ = results
    ratio = async_.per_hour / sync.per_hour
    print(f"e2e-bench: async/sync={ratio:.2f} gain={async_.gain_points:.1f}")


if __name__ == "__main__":
    main()
