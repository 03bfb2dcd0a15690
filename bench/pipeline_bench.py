"""The real pipeline against the ideal one: relayrl's services run the reference rollout
pipeline (docs/simulation.md#pipeline-bench) in `sync`, partial eta=1 and partial eta=2, and
`relayrl sim` simulates the same pipeline on the same episode durations and parameters, side
by side in one run.

What runs, per design, all real processes on loopback:
    redis-server (the TransferQueue), relayrl-reward (rule-based scoring), relayrl-gateway
    (throttle launched < (v + 1 + eta) * B, one single-turn rollout per group),
    relayrl-weightsync (pause mode keep: in-flight rollouts freeze during a switch and continue
    on the new version — partial rollout), relayrl-trainer (sync, or separate_async with eta);
    and, in place of vLLM, the engine emulator (`python -m relayrl_testkit.emulator`), whose
    i-th generate request takes episode i of the simulator's duration model times the time
    scale, and whose weight load really pulls the version from weight-sync, then takes the
    scaled sync time.
Labelled stand-ins: the engine is the emulator (a load generator, not a model) and the
trainer's policy update is a sleep of the scaled train time (`research.emulated_update_s`, benchmark
only: every step record says `emulated_update: 1`). Everything between them — claims, leases,
trajectories in Redis, reward scoring, the staleness gate, the version switch across gateway
and engine, publishing the (tiny) model's real weights — is the production code.

One prompt group is one rollout (samples_per_prompt 1), so the simulator's rollout is the
trainer's group; `n_slots` is the gateway's max_inflight_groups. The trainer waits for each
version's commit before its next step (`wait_for_commit`), so the simulation runs with
`train_during_sync=False` (the seed's own figures let training overlap the sync).

Throughput is trained rollouts per hour of pipeline time, both sides measured in simulated
seconds (real wall seconds / time scale), from the first rollout's launch (its arrival at the
engine) to the end of the last step's update, as the simulation's clock runs (the sync after
the last step serves a step that never runs). Staleness is the simulator's: the trainer's step
minus the version that launched a rollout (the trainer's `policy_lag`).

The last line is exactly:
    pipeline-bench: async1/sync=<measured ratio> fidelity=<min over designs of measured/simulated>
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relayrl.core.config import LoggingConfig
from relayrl.core.ports import free_port
from relayrl.core.records import StepRecord, read_records
from relayrl.core.service_process import ServiceProcess, console_script
from relayrl.models.tiny import TinyModelConfig, init_model
from relayrl.sim.durations import EpisodeModel
from relayrl.sim.pipeline import PipelineConfig, SimResult, simulate
from relayrl.stack import SERVICES, EngineDiscovery, RolloutShape, StackConfig, Wiring
from relayrl.stack.local import LocalPorts
from relayrl.tq.config import TQConfig
from relayrl.tq.server import RedisServer

PARTITION = "train"
NAMESPACE = "pipebench"


@dataclass(frozen=True)
class Design:
    name: str
    mode: str  # trainer mode
    eta: int
    pause_mode: str = "keep"  # weight-sync's: keep = partial rollout, wait = drain

    @property
    def drain(self) -> bool:
        return self.pause_mode == "wait"


DESIGNS = {
    "sync": Design("sync", "sync", 0),
    "partial1": Design("partial eta=1", "separate_async", 1),
    "partial2": Design("partial eta=2", "separate_async", 2),
    # Not run by default: one-step-off with drain (the switch waits for in-flight rollouts).
    "drain1": Design("drain eta=1", "separate_async", 1, "wait"),
}


@dataclass
class Measured:
    design: Design
    steps: int
    trained: int
    pipeline_s: float  # simulated seconds
    lag_mean: float
    lag_max: int
    served: int  # generate requests the emulator finished
    busy: float  # slot utilisation: running or paused rollout time / (slots x pipeline time)

    @property
    def per_hour(self) -> float:
        return self.trained / self.pipeline_s * 3600


def _raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops the child processes."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def write_prompts(path: Path, count: int) -> Path:
    lines = [
        json.dumps({"prompt": f"{i} + 2 =", "ground_truth": str(i + 2), "data_source": "arith"})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- the real pipeline -----------------------------------------------------------------------


class EmulatorProcess:
    """`python -m relayrl_testkit.emulator` as a child process, stopped by PID."""

    def __init__(self, args: argparse.Namespace, workdir: Path, vocab_size: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.ready = workdir / "ready.json"
        self.log = workdir / "requests.jsonl"
        self.argv = [
            sys.executable, "-m", "relayrl_testkit.emulator",
            "--port", "0", "--ready-file", str(self.ready), "--log", str(self.log),
            "--time-scale", str(args.scale), "--seed", str(args.seed),
            "--sync-time-s", str(args.sync_time_s), "--vocab-size", str(vocab_size),
            "--initial-version", "0",
        ]  # fmt: skip
        self.output = workdir / "emulator.log"
        self.process: Any = None
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> EmulatorProcess:
        import subprocess

        with self.output.open("wb") as out:
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine emulator did not start:\n{self.output.read_text()}")
            time.sleep(0.05)
        self.url = json.loads(self.ready.read_text())["url"]
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except Exception:
            self.process.kill()
            self.process.wait(timeout=10)


def compose_stack(
    args: argparse.Namespace, design: Design, redis_url: str, model_dir: Path, engine: str,
    root: Path,
) -> StackConfig:  # fmt: skip
    """The system as `relayrl up` wires it (relayrl.stack), with this benchmark's own knobs:
    the emulated update, one rollout per group, no DAPO filter, no stale drops."""
    wiring = Wiring(
        tq=TQConfig(url=redis_url, namespace=NAMESPACE, partitions=[PARTITION]),
        partition=PARTITION,
        model_path=model_dir,
        mode=design.mode,
        rollout_shape=RolloutShape(
            eta=design.eta,
            batch_groups=args.batch_size,
            samples_per_prompt=1,
            max_tokens=args.max_tokens,
        ),
        endpoints=LocalPorts.choose().endpoints(),
        engines=EngineDiscovery(urls=[engine]),
        logging=LoggingConfig(json=True, level="WARNING"),
    )
    own: dict[str, dict[str, Any]] = {
        "reward": {"tq_scorer": {"reclaim_idle_s": 10}},
        "gateway": {
            "engines": {"health_interval_s": 1.0},
            "rollout": {"max_inflight_groups": args.slots, "claimer": "gateway-0"},
            "agent_http": {"enabled": False},
            "weightsync": {"default_timeout_s": 30},
        },
        "weightsync": {
            "engines": {"load_timeout_s": 120},
            "pause_mode": design.pause_mode,
            "metrics_log": str(root / "transfers.jsonl"),
            "gateway": {"default_timeout_s": 30},
        },
        "trainer": {
            "model": {"max_seq_len": 256},
            "algorithm": {
                "dapo_filter": False,
                # The simulator does not drop stale rollouts (the seed's figures do not).
                "staleness": {"policy": "drop", "threshold": 64},
            },
            "data": {
                "prompts_file": str(write_prompts(root / "prompts.jsonl", 4 * args.batch_size)),
                "poll_interval_s": 0.005,
            },
            "publish": {"wait_for_commit": True},
            "gateway": {"default_timeout_s": 30},
            "research": {"emulated_update_s": args.train_time_s * args.scale},
            "total_steps": args.steps,
            "metrics_log": str(root / "steps.jsonl"),
        },
    }
    return StackConfig.compose(wiring, own=own)


def run_real(
    args: argparse.Namespace, design: Design, model_dir: Path, vocab_size: int, root: Path
) -> Measured:
    root.mkdir(parents=True)
    children: list[Any] = []
    redis = RedisServer(root / "redis", port=free_port())
    try:
        redis.start()
        children.append(redis)
        emulator = EmulatorProcess(args, root / "engine", vocab_size).start()
        children.append(emulator)
        stack = compose_stack(args, design, redis.url, model_dir, emulator.url, root)
        services = {}
        for name in SERVICES:
            services[name] = ServiceProcess(
                f"relayrl-{name}", stack.service_file(name), root / name
            )
            services[name].start(timeout_s=180)
            children.append(services[name])
        trainer = services["trainer"]
        code = trainer.process.wait(timeout=args.timeout_s)
        if code != 0:
            raise RuntimeError(f"the trainer exited {code}:\n{trainer.log()[-3000:]}")
    finally:
        for child in reversed(children):
            child.stop()
    records = read_records(root / "steps.jsonl", StepRecord)
    if len(records) != args.steps or not all(r.emulated_update == 1.0 for r in records):
        raise RuntimeError(f"{design.name}: expected {args.steps} emulated steps in steps.jsonl")
    lags = [(lag, n) for r in records for lag, n in r.policy_lag_histogram.items()]
    trained = sum(n for _, n in lags)
    # the emulator's request log (relayrl_testkit.emulator.RequestLog), not a run record
    served = [json.loads(x) for x in emulator.log.read_text().splitlines() if x.strip()]
    expected = EpisodeModel().durations(args.seed, len(served))
    if any(abs(r["duration_s"] - expected[r["index"]]) > 1e-6 for r in served):
        raise RuntimeError(f"{design.name}: the emulator served durations the model did not draw")
    # The simulation's clock: from the first launch to the end of the last step's update (the
    # sync after it serves a step that never runs).
    started = min(r["arrival_time"] for r in served)
    ended = records[-1].time - records[-1].phases_s["publish"]
    busy_s = sum(
        max(0.0, min(r["finish_time"], ended) - r["arrival_time"])
        for r in served
        if r["arrival_time"] < ended
    )
    return Measured(
        design=design,
        steps=len(records),
        trained=trained,
        pipeline_s=(ended - started) / args.scale,
        lag_mean=sum(lag * n for lag, n in lags) / max(trained, 1),
        lag_max=max((lag for lag, _ in lags), default=0),
        served=len(served),
        busy=busy_s / (args.slots * (ended - started)),
    )


# --- the simulated pipeline ------------------------------------------------------------------


def run_sim(args: argparse.Namespace, design: Design) -> SimResult:
    config = PipelineConfig(
        n_slots=args.slots,
        batch_size=args.batch_size,
        train_time_s=args.train_time_s,
        sync_time_s=args.sync_time_s,
        steps=args.steps,
        eta=design.eta,
        drain=design.drain,
        train_during_sync=False,
    )
    needed = (args.steps + design.eta + 1) * args.batch_size
    return simulate(config, EpisodeModel().durations(args.seed, needed))


# --- the run ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--designs",
        default="sync,partial1,partial2",
        help=f"comma-separated, of {', '.join(DESIGNS)}",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=0.01,
        help="wall seconds per simulated second (default 1/100)",
    )
    parser.add_argument("--slots", type=int, default=64, help="generation slots (in flight)")
    parser.add_argument("--batch-size", type=int, default=64, help="rollouts per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--train-time-s", type=float, default=60.0, help="simulated seconds")
    parser.add_argument("--sync-time-s", type=float, default=10.0, help="simulated seconds")
    parser.add_argument("--max-tokens", type=int, default=32, help="response tokens per rollout")
    parser.add_argument("--seed", type=int, default=0, help="episode durations")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per design, wall")
    parser.add_argument("--keep", type=Path, help="keep every log and record under this folder")
    args = parser.parse_args(argv)  # fmt: skip
    unknown = [d for d in args.designs.split(",") if d not in DESIGNS]
    if unknown or "sync" not in args.designs.split(",") or "partial1" not in args.designs:
        parser.error(f"--designs needs sync and partial1, of {', '.join(DESIGNS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _raise_on_sigterm()
    console_script("relayrl-trainer")  # fail early when the services are not installed
    root = args.keep or Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "tiny"
    if not (model_dir / "config.json").exists():
        init_model(model_dir, TinyModelConfig(), overwrite=True)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(
        f"pipeline-bench: {args.slots} slots, {args.batch_size} rollouts/step, train "
        f"{args.train_time_s:g} s, sync {args.sync_time_s:g} s, {args.steps} steps, time scale "
        f"{args.scale:g} (simulated seconds below), durations seed {args.seed}"
    )
    rows: list[tuple[Measured, SimResult]] = []
    for key in args.designs.split(","):
        design = DESIGNS[key]
        sim = run_sim(args, design)
        started = time.monotonic()
        real = run_real(args, design, model_dir, vocab_size, root / key)
        print(
            f"  {design.name:<14} real run {time.monotonic() - started:5.1f} s wall, "
            f"{real.served} episodes served"
        )
        rows.append((real, sim))
    print()
    header = (
        f"{'design':<14} {'measured/h':>10} {'simulated/h':>11} {'ratio':>6}  "
        f"{'busy m/s':<11} {'staleness mean m/s':<19} {'max m/s':<7}"
    )
    print(header)
    print("-" * len(header))
    for real, sim in rows:
        print(
            f"{real.design.name:<14} {real.per_hour:10.0f} {sim.rollouts_per_hour:11.0f} "
            f"{real.per_hour / sim.rollouts_per_hour:6.3f}  "
            f"{real.busy:4.0%}/{sim.utilisation:<6.0%} "
            f"{real.lag_mean:8.2f}/{sim.staleness_mean:<10.2f} "
            f"{real.lag_max:3d}/{sim.staleness_max:<3d}".rstrip()
        )
    print(
        "m/s: measured / simulated; staleness: trainer step minus the version that launched "
        "the rollout"
    )
    by_key = {real.design.name: real for real, _ in rows}
    speedup = by_key[DESIGNS["partial1"].name].per_hour / by_key[DESIGNS["sync"].name].per_hour
    fidelity = float(np.min([real.per_hour / sim.rollouts_per_hour for real, sim in rows]))
    print(f"pipeline-bench: async1/sync={speedup:.2f} fidelity={fidelity:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
