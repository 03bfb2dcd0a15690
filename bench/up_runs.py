"""Shared by the benches that drive `relayrl up` end to end (e2e, staleness): run it with a
generated config, find the run folder, and read what the run wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from relayrl.core.records import EvalRecord, StepRecord, read_records
from relayrl.up.config import split_cpus
from relayrl.up.run_state import RunState


@dataclass
class UpRun:
    """What a finished `relayrl up` run left in its folder."""

    run_dir: Path
    wall_s: float

    @property
    def state(self) -> RunState:
        return RunState.read(self.run_dir)

    @property
    def config(self) -> dict[str, Any]:
        return yaml.safe_load((self.run_dir / "config.yaml").read_text())

    @property
    def steps(self) -> list[StepRecord]:
        """The trainer's step records, in step order (a resumed step counts once)."""
        records = read_records(self.run_dir / "trainer" / "steps.jsonl", StepRecord)
        last = {r.step: r for r in records}
        return [last[s] for s in sorted(last)]

    @property
    def evals(self) -> list[EvalRecord]:
        return read_records(self.run_dir / "eval.jsonl", EvalRecord)

    def accuracy(self, kind: str) -> float:
        """Greedy held-out accuracy of the first `warm_start` or the last `final` evaluation."""
        records = self.evals if kind == "warm_start" else list(reversed(self.evals))
        accuracy = next(e for e in records if e.kind == kind).accuracy
        if accuracy is None:
            raise RuntimeError(f"the {kind} evaluation of {self.run_dir} failed")
        return accuracy

    def dashboard_values(self) -> tuple[int, dict[str, float]]:
        """The trainer's last /metrics scrape that `relayrl up` kept (`metrics/trainer.prom`,
        what Prometheus and so the dashboards saw): the step it shows and its per-step
        `relayrl_trainer_step_value{metric=...}` gauges."""
        from prometheus_client.parser import text_string_to_metric_families

        text = (self.run_dir / "metrics" / "trainer.prom").read_text()
        step, values = -1, {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "relayrl_trainer_completed_steps":
                    step = int(sample.value)
                elif sample.name == "relayrl_trainer_step_value":
                    values[sample.labels["metric"]] = sample.value
        return step, values

    @property
    def train_s(self) -> float:
        state = self.state
        return state["training_finished"] - state["training_started"]


def default_placement() -> dict[str, str] | None:
    """What `placement.auto` chooses (relayrl.up.config.split_cpus), written out so that a
    bench's config says it; None on one CPU."""
    split = split_cpus(os.sched_getaffinity(0))
    if split is None:
        return None
    engine, trainer = split
    return {"engine": engine, "trainer": trainer, "services": trainer}


def run_up(
    label: str,
    config: dict[str, Any],
    runs_dir: Path,
    *,
    bench: str,
    extra_args: list[str] | None = None,
    watch: Callable[[Path], bool] | None = None,
) -> UpRun:
    """`relayrl up --config <runs_dir>/<label>.yaml` (written from `config`), its output in
    `<runs_dir>/<label>.log`; exits the bench with the log's tail if the run fails. `watch`
    is called with the run folder every 2 s while the run goes, until it returns True."""
    config_path = runs_dir / f"{label}.yaml"
    config_path.write_text(yaml.safe_dump({"runs_dir": str(runs_dir), **config}))
    argv = [
        str(Path(sys.executable).parent / "relayrl"), "up", "--config", str(config_path),
        *(extra_args or []),
    ]  # fmt: skip
    started = time.monotonic()
    log_path = runs_dir / f"{label}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(2.0)
            if watch is not None and (run_dir := _run_dir(log_path)) is not None:
                watch = None if watch(run_dir) else watch
        code = process.returncode
    output = log_path.read_text(errors="replace")
    if code != 0:
        sys.exit(f"{bench}: relayrl up ({label}) exited {code}:\n{output[-3000:]}")
    run_dir = _run_dir(log_path)
    assert run_dir is not None, f"no run folder in {log_path}"
    run = UpRun(run_dir, time.monotonic() - started)
    print(f"  {label:<15} done in {run.wall_s:.0f} s ({run.run_dir})", file=sys.stderr)
    return run


def _run_dir(log_path: Path) -> Path | None:
    """The run folder `relayrl up` announced in its output, once it has."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("relayrl up: run "):
            return Path(line.rsplit(" ", 1)[-1])
    return None
