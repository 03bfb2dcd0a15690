"""Chaos on the main job: every part of a short `relayrl up` run is SIGKILLed (with its process
group, as a crashed pod) while it trains, and each run is then audited (`relayrl audit`: no
group or prompt lost, none trained twice, no prompt skipped, no span sampled by weights that
were not committed).

Round 0 is the fixed schedule, one kill after another in one run, each at the moment that
hurts most:
    trainer_early      the trainer before its first checkpoint (it starts over from step 0)
    redis              redis-server (it replays its AOF; every client waits it out)
    engine             the vLLM engine while it generates (its rollouts fail as infra)
    weightsync         weight-sync while a version is in transfer
    trainer            the trainer after a checkpoint (it resumes from it)
    gateway+reward     the gateway and the reward-service together
Rounds 1.. draw `--kills-per-round` parts at random (seeded) and kill them after a random
number of steps each. A kill's recovery time is from the kill to the next committed version.

The last line is exactly (one line; `lost` counts groups and prompts lost):
    chaos-bench: kills=<n> runs_completed=<n>/<n> lost=<n> trained_twice=<n>
                 stale_served=<n> prompts_skipped=<n> max_recovery_s=<s>
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relayrl.core.records import StepRecord, TransferRecord, read_records
from relayrl.up.stack_state import ChildState, StackState
from relayrl_testkit.helpers.up import deep_update

FIXED = ("trainer_early", "redis", "engine", "weightsync", "trainer", "gateway+reward")
PARTS = ("redis", "engine", "weightsync", "trainer", "gateway", "reward", "gateway+reward")
CHECKPOINT_INTERVAL = 3
# A short run: a small warm start, 2 groups of 4 per step, no DAPO filter (a weak warm start
# gives many groups without signal; the filter has its own tests).
RUN_CONFIG: dict[str, Any] = {
    "task": {"train_prompts": 400, "heldout_prompts": 20},
    "warm_start": {"examples": 300, "epochs": 1},
    "train": {
        "batch_groups": 2,
        "samples_per_prompt": 4,
        "checkpoint_interval_steps": CHECKPOINT_INTERVAL,
        "mode": "separate_async",
    },
    "eval": {"interval_steps": 0, "sampled": False},
    "engine": {"max_num_seqs": 32},
    "supervision": {"max_restarts": 10, "restart_backoff_s": 1.0},
    "services": {"trainer": {"algorithm": {"dapo_filter": False}}},
}
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Kill:
    part: str
    step: int  # trainer steps logged when it was killed
    at: float  # wall time of the kill
    moment: str  # what was going on
    restarted_s: float | None = None  # kill -> the supervisor has it running (ready) again
    recovery_s: float | None = None  # kill -> next committed version


@dataclass
class RunResult:
    name: str
    completed: bool
    kills: list[Kill] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class ChaosError(RuntimeError):
    pass


class UpRun:
    """One `relayrl up` in its own session, watched through its run folder."""

    def __init__(
        self, runs_dir: Path, steps: int, log: Path, over: dict[str, Any] | None = None
    ) -> None:
        """`over` is merged into RUN_CONFIG (a dict in place of a dict is merged into it)."""
        runs_dir.mkdir(parents=True, exist_ok=True)
        config = deep_update(deep_update(RUN_CONFIG, over or {}), {"train": {"steps": steps}})
        config_path = runs_dir / f"{log.stem}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.log = log
        self.steps = steps
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "relayrl"), "up", "--config", str(config_path),
                 "--runs-dir", str(runs_dir)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self._run_dir: Path | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            match = re.search(r"^relayrl up: run \S+ in (\S+)$", self.output(), re.MULTILINE)
            if match is None:
                raise ChaosError("relayrl up has not announced its run folder yet")
            self._run_dir = Path(match.group(1))
        return self._run_dir

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = "\n".join(self.output().splitlines()[-15:])
            raise ChaosError(f"relayrl up exited {self.process.returncode}:\n{tail}")

    def children(self) -> dict[str, ChildState]:
        stack = StackState.read_if_any(self.run_dir)
        return {} if stack is None else dict(stack.children)

    def step_records(self) -> list[StepRecord]:
        return read_records(self.run_dir / "trainer" / "steps.jsonl", StepRecord)

    def steps_logged(self) -> int:
        return len({r.step for r in self.step_records()})

    def commits_after(self, t: float) -> list[float]:
        records = read_records(self.run_dir / "weightsync" / "transfers.jsonl", TransferRecord)
        return sorted(r.time for r in records if r.state == "committed" and r.time > t)

    def checkpoints(self) -> list[int]:
        root = self.run_dir / "trainer" / "checkpoints"
        return sorted(int(p.name[5:]) for p in root.glob("step-*")) if root.exists() else []

    def wait(self, condition: Any, what: str, timeout_s: float, poll_s: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(ChaosError, OSError, ValueError, KeyError):
                result = condition()
                if result:
                    return result
            time.sleep(poll_s)
        raise ChaosError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(180)
            except subprocess.TimeoutExpired:
                self.process.kill()
        with contextlib.suppress(ChaosError):
            for child in self.children().values():
                if child.pid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.pid, signal.SIGKILL)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def engine_generating(run: UpRun) -> bool:
    url = f"{run.children()['engine-0'].url}/metrics"
    with NO_PROXY.open(url, timeout=2) as response:
        text = response.read().decode()
    match = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    return match is not None and float(match.group(1)) > 0


def weightsync_transferring(run: UpRun) -> bool:
    from relayrl.core.grpc_client import sync_channel
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
    from relayrl.up.secrets import operator_identity

    target = str(run.children()["weightsync"].target)
    with sync_channel(target, operator_identity(run.run_dir), []) as channel:
        reply = weightsync_pb2_grpc.WeightSyncStub(channel).GetVersion(
            pb.GetVersionRequest(), timeout=2
        )
    return reply.HasField("in_progress") and bool(reply.in_progress.transfer_id)


def kill(run: UpRun, part: str, min_step: int) -> Kill:
    """Waits for the moment `part` is killed at, kills it, and returns what happened."""
    run.wait(lambda: run.steps_logged() >= min_step, f"step {min_step}", 900)
    moment = "training"
    if part == "trainer_early":
        if run.checkpoints():
            raise ChaosError("trainer_early: a checkpoint exists already")
        moment = "before its first checkpoint"
    elif part == "trainer":
        run.wait(lambda: run.checkpoints() and run.steps_logged() > run.checkpoints()[-1],
                 "a step after a checkpoint", 900)  # fmt: skip
        moment = f"after the checkpoint of step {run.checkpoints()[-1]}"
    elif part == "engine":
        moment = "mid-generation"
        try:
            run.wait(lambda: engine_generating(run), "the engine to generate", 120, poll_s=0.05)
        except ChaosError:
            moment = "idle (no generation seen in 120 s)"
    elif part == "weightsync":
        moment = "mid-transfer"
        try:
            run.wait(lambda: weightsync_transferring(run), "a transfer", 120, poll_s=0.01)
        except ChaosError:
            moment = "between transfers (no transfer seen in 120 s)"
    children = run.children()
    names = {"trainer_early": ["trainer"], "engine": ["engine-0"], "gateway+reward":
             ["gateway", "reward"]}.get(part, [part])  # fmt: skip
    before = {name: children[name].restarts for name in names}
    at = time.time()
    for name in names:
        pid = children[name].pid
        if pid is None:
            raise ChaosError(f"{name} has no process to kill (stack.json)")
        kill_group(pid)
    record = Kill(part, run.steps_logged(), at, moment)

    def restarted() -> bool:
        now = run.children()
        return all(now[name].restarts > before[name] for name in names)

    run.wait(restarted, f"{part} to be restarted", 600, poll_s=0.05)
    record.restarted_s = time.time() - at
    record.recovery_s = run.wait(
        lambda: (commits := run.commits_after(at)) and max(commits[0] - at, 1e-3),
        f"a version committed after the {part} kill",
        900,
    )
    return record


AUDIT_KINDS = ("lost", "prompts_lost", "trained_twice", "stale_served")
"""What `relayrl audit` may find wrong with a run; each must be empty."""


def audit_record(report: Any) -> dict[str, Any]:
    """An AuditReport as JSON with its summary."""
    record: dict[str, Any] = report.to_json() | {"summary": report.summary()}
    return record


def audit_totals(audits: list[dict[str, Any]]) -> dict[str, int]:
    """The benches' counts over runs' audit records: `lost` counts groups and prompts lost,
    `prompts_skipped` the prompts whose retry budget ran out (relayrl.up.audit)."""
    total = {k: sum(len(a.get(k, [])) for a in audits) for k in AUDIT_KINDS}
    total["lost"] += total.pop("prompts_lost")
    total["prompts_skipped"] = sum(a.get("prompts", {}).get("skipped", 0) for a in audits)
    return total


def audit_into(result: Any, run_dir: Path, say: Any) -> Any:
    """Audits a stopped run into `result` (its `audit`, or its `error` when the audit cannot
    run), says what it found, and returns `result`."""
    from relayrl.up.audit import audit_run

    try:
        report = audit_run(run_dir)
        result.audit = audit_record(report)
        say(f"  {result.name}: {report.summary()}")
        for kind in AUDIT_KINDS:
            for line in result.audit[kind][:5]:
                say(f"    {kind}: {line}")
    except Exception as exc:  # an audit that cannot run counts the run as failed
        result.error = result.error or f"audit failed: {exc}"
    if result.error:
        say(f"  {result.name}: FAILED: {result.error}")
    return result


def one_run(name: str, parts: list[str], steps: int, runs_dir: Path, rng: random.Random,
            say: Any) -> RunResult:  # fmt: skip

    run = UpRun(runs_dir / name, steps, runs_dir / f"{name}.log")
    result = RunResult(name, completed=False)
    try:
        step = 1
        for part in parts:
            record = kill(run, part, step)
            result.kills.append(record)
            say(f"  {name}: killed {part:<14} at step {record.step:>2} ({record.moment}); "
                f"back after {record.restarted_s:.1f} s, next version committed "
                f"{record.recovery_s:.1f} s after the kill")  # fmt: skip
            step = run.steps_logged() + (1 if name == "fixed" else rng.randint(0, 2))
        code = run.process.wait(1800)
        result.completed = code == 0 and f"for {steps} steps" in run.output()
        if not result.completed:
            result.error = f"relayrl up exited {code}: " + run.output().splitlines()[-1]
    except (ChaosError, subprocess.TimeoutExpired) as exc:
        result.error = str(exc)
    finally:
        run.stop()
    return audit_into(result, run.run_dir, say)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="random rounds after the fixed one")
    parser.add_argument("--kills-per-round", type=int, default=3, help="kills in a random round")
    parser.add_argument("--steps", type=int, default=16, help="trainer steps of each run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random schedules")
    parser.add_argument("--keep", type=Path, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args(argv)
    for name in ("rounds", "kills_per_round"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.steps < 2 * len(FIXED) + 2:
        parser.error(f"--steps must be at least {2 * len(FIXED) + 2} for the fixed schedule")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    schedules = [("fixed", list(FIXED))] + [
        (f"random-{i}", [rng.choice(PARTS) for _ in range(args.kills_per_round)])
        for i in range(1, args.rounds + 1)
    ]
    print(f"chaos-bench: {len(schedules)} runs of {args.steps} steps, {RUN_CONFIG['train']}")
    keep = args.keep or Path(tempfile.mkdtemp(prefix="relayrl-chaos-"))
    results = [
        one_run(name, parts, args.steps, keep, rng, lambda line: print(line, flush=True))
        for name, parts in schedules
    ]
    kills = [k for r in results for k in r.kills]
    by_part: dict[str, list[float]] = {}
    for k in kills:
        by_part.setdefault(k.part, []).append(k.recovery_s or 0.0)
    print("recovery (kill -> next committed version), seconds:")
    for part, values in sorted(by_part.items()):
        mean = sum(values) / len(values)
        print(f"  {part:<15} n={len(values)}  max={max(values):6.1f}  mean={mean:6.1f}")
    records = [r.__dict__ | {"kills": [k.__dict__ for k in r.kills]} for r in results]
    (keep / "chaos.json").write_text(json.dumps(records, indent=1))
    completed = sum(r.completed and not r.error for r in results)
    total = audit_totals([r.audit for r in results])
    max_recovery = max((k.recovery_s or 0.0 for k in kills), default=0.0)
    print(f"runs kept in {keep}")
    print(
        f"chaos-bench: kills={len(kills)} runs_completed={completed}/{len(results)} "
        f"lost={total['lost']} trained_twice={total['trained_twice']} "
        f"stale_served={total['stale_served']} prompts_skipped={total['prompts_skipped']} "
        f"max_recovery_s={max_recovery:.1f}"
    )
    return 0 if completed == len(results) and not any(total.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
