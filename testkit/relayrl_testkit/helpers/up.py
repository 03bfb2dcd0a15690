"""Running `relayrl up` as a user does (the console script, a config file, a runs folder) and
auditing what it left: the TransferQueue (Redis restarted on the run's AOF), the trainer's
step log, weight-sync's transfer log, the metrics snapshots, and the process table."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from relayrl.core.records import EvalRecord, StepRecord, TransferRecord, read_records
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.model import GroupStatus
from relayrl.tq.server import RedisServer
from relayrl.up.run_state import RunState
from relayrl.up.stack_state import StackState
from relayrl_testkit import REPO

NAMESPACE, PARTITION = "relayrl", "train"

# A short run: a small warm start (cached under runs/cache for the whole test session), few
# groups, no DAPO filter (a weak warm start gives many groups without signal, and each would
# cost another rollout; the filter has its own tests).
SHORT_RUN: dict[str, Any] = {
    "task": {"train_prompts": 400, "heldout_prompts": 20},
    "warm_start": {"examples": 300, "epochs": 1},
    "train": {
        "steps": 3,
        "batch_groups": 2,
        "samples_per_prompt": 4,
        "checkpoint_interval_steps": 1,
    },
    "eval": {"interval_steps": 2, "sampled": False},
    "engine": {"max_num_seqs": 32},
    "services": {"trainer": {"algorithm": {"dapo_filter": False}}},
}


def deep_update(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            deep_update(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def sharing_cache(runs_dir: Path, cache: Path) -> Path:
    """`runs_dir` whose `cache/` (the tiny model and the warm start, each keyed by its inputs)
    is the folder `cache`, so that the runs of a test session build them once."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    (runs_dir / "cache").symlink_to(cache, target_is_directory=True)
    return runs_dir


def relayrl() -> str:
    return str(Path(sys.executable).parent / "relayrl")


@dataclass
class UpProcess:
    """`relayrl up` in its own session (so a test's SIGINT reaches only it)."""

    process: subprocess.Popen[bytes]
    runs_dir: Path
    log_path: Path

    @classmethod
    def start(
        cls,
        runs_dir: Path,
        config: dict[str, Any],
        *args: str,
        env: dict[str, str] | None = None,
    ) -> UpProcess:
        """`relayrl up --config <config> --runs-dir <runs_dir> *args`, with `env` added to the
        environment."""
        runs_dir.mkdir(parents=True, exist_ok=True)
        config_path = runs_dir / f"up-{time.monotonic_ns()}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log_path = config_path.with_suffix(".log")
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [relayrl(), "up", "--config", str(config_path), "--runs-dir", str(runs_dir), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **env} if env else None,
            )
        return cls(process, runs_dir, log_path)

    @classmethod
    def make_run(cls, repo: Path, config: dict[str, Any], *args: str) -> UpProcess:
        """`make run` in `repo` (a copy of the repository root), as the README says, with the
        config given by a relative path and the default, relative, runs folder."""
        (repo / "short.yaml").write_text(yaml.safe_dump(config))
        log_path = repo / "make-run.log"
        up_args = " ".join(["--config", "short.yaml", *args])
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                ["make", "run", f"UP_ARGS={up_args}"],
                cwd=repo, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        return cls(process, repo / "runs", log_path)

    @classmethod
    def resume(cls, run_dir: Path, *args: str) -> UpProcess:
        log_path = run_dir.parent / f"resume-{time.monotonic_ns()}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [relayrl(), "up", "--resume", str(run_dir), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return cls(process, run_dir.parent, log_path)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def run_dir(self) -> Path:
        for line in self.output().splitlines():
            if line.startswith("relayrl up: run ") or line.startswith("relayrl up: resuming "):
                return Path(line.rsplit(" ", 1)[-1])
        raise AssertionError(f"no run folder announced yet:\n{self.output()}")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(180)
            raise AssertionError(
                f"relayrl up did not finish in {timeout_s} s:\n{self.output()}"
            ) from None

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    def stop(self) -> None:
        """Cleanup for a failed test: SIGINT, then SIGKILL to whatever the run left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(180)
            except subprocess.TimeoutExpired:
                self.process.kill()
        try:
            for pid in stack_pids(self.run_dir):
                kill_group(pid)
        except AssertionError:
            pass


def repository_copy(destination: Path) -> Path:
    """The repository as a fresh clone has it (tracked files, with their times) plus what
    `make setup` built: the generated protobuf code, and the virtual environment (linked), so
    that `make run` in the copy finds setup done and goes straight to `relayrl up`."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    built = [
        p.relative_to(REPO) for p in (REPO / "services/relayrl/proto").rglob("*") if p.is_file()
    ]
    for relative in {*(Path(f) for f in tracked.split("\0") if f), *built}:
        source = REPO / relative
        if source.is_file():
            (destination / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / relative)
    (destination / ".venv").symlink_to(REPO / ".venv")
    _setup_done_in(destination)
    return destination


def _setup_done_in(copy: Path) -> None:
    """No input of `make setup` in the copy is newer than the linked venv's setup stamp, and
    the copied generated code is newer than both: else `make run` there would set up again and
    point the shared venv's editable installs at the copy (a temporary folder), or regenerate
    the protobuf code of the package the venv imports. The inputs are the stamps' prerequisites
    in the Makefile."""
    stamp = REPO / ".venv" / ".relayrl-setup"
    if not stamp.exists():
        return
    done = stamp.stat().st_mtime
    rule = next(
        line for line in (copy / "Makefile").read_text().splitlines()
        if line.startswith("$(SETUP_STAMP):")
    )  # fmt: skip
    for name in rule.split(":", 1)[1].split():
        path = copy / name
        if path.exists() and path.stat().st_mtime > done:
            os.utime(path, (done, done))
    generated = copy / "services/relayrl/proto/GENERATED_FROM"
    if generated.exists():
        generated.touch()  # `make protos` built it from these very sources


def stack_state(run_dir: Path) -> StackState:
    return StackState.read(run_dir)


def stack_pids(run_dir: Path) -> list[int]:
    stack = StackState.read_if_any(run_dir)
    return [] if stack is None else stack.pids()


def stack_pid(run_dir: Path, child: str) -> int | None:
    """The PID the stack recorded for `child` (`trainer`, `engine-0`, ...), if it has one."""
    stack = StackState.read_if_any(run_dir)
    return None if stack is None else stack.pid(child)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def steps_logged(run_dir: Path) -> list[StepRecord]:
    """The run's trainer step log so far (a line still being written is not there yet)."""
    return read_records(run_dir / "trainer" / "steps.jsonl", StepRecord)


def wait_for_steps(up: UpProcess, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.process.poll() is not None:
            raise AssertionError(f"relayrl up exited {up.process.returncode}:\n{up.output()}")
        try:
            if len({r.step for r in steps_logged(up.run_dir)}) >= n:
                return
        except AssertionError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{n} steps not logged in {timeout_s} s:\n{up.output()}")


def pause_trainer(run_dir: Path) -> None:
    """Holds a running run's trainer before its next step (its Control RPC, as the operator),
    so that what a test checks on the live stack is not raced by the trainer finishing."""
    _control_trainer(run_dir, "CONTROL_ACTION_PAUSE")


def resume_trainer(run_dir: Path) -> None:
    """Lets a trainer held by `pause_trainer` go on."""
    _control_trainer(run_dir, "CONTROL_ACTION_RESUME")


def _control_trainer(run_dir: Path, action: str) -> None:
    from relayrl.core.grpc_client import sync_channel
    from relayrl.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
    from relayrl.up.secrets import operator_identity

    target = str(stack_state(run_dir).children["trainer"].target)
    with sync_channel(target, operator_identity(run_dir), []) as channel:
        trainer_pb2_grpc.TrainerStub(channel).Control(
            trainer_pb2.ControlRequest(action=trainer_pb2.ControlAction.Value(action)),
            timeout=30,
        )


def processes_of(run_dir: Path) -> list[str]:
    """Live processes whose command line or working directory names the run folder, or
    whose PID the stack recorded: what a clean shutdown must not leave behind."""
    pids = set(stack_pids(run_dir))
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(process.info["cmdline"] or [])
            if process.pid in pids or str(run_dir) in cmdline:
                found.append(f"{process.pid}: {cmdline[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def running(*scripts: str | Path) -> list[str]:
    """Live processes whose command line names one of `scripts` (agent programs a run or a
    gateway must have stopped)."""
    names = [str(script) for script in scripts]
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or ())
        if any(name in cmdline for name in names):
            found.append(f"{process.info['pid']}: {cmdline}")
    return found


def service_warnings(run_dir: Path, limit: int = 60) -> str:
    """The WARNING and ERROR lines of the run's services' logs (the engines' are vLLM's own
    noise): what a failed check shows besides its own message."""
    lines = []
    for service in ("gateway", "reward", "weightsync", "trainer"):
        log = run_dir / "logs" / f"{service}.log"
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if '"level": "WARNING"' in line or '"level": "ERROR"' in line:  # JSON lines
                    lines.append(f"{service}: {line[:400]}")
    return "\n".join(lines[-limit:])


@dataclass
class Audit:
    """What the TransferQueue says happened to every group and trajectory of a run."""

    groups: dict[str, Any] = field(default_factory=dict)  # uid -> GroupWithTrajectories
    statuses: Counter[str] = field(default_factory=Counter)
    consume_events: Counter[str] = field(default_factory=Counter)  # uid -> "-> consumed" count

    def infra_trajectories(self) -> list[str]:
        """One line per trajectory tagged infra: its key and every reason the queue kept."""
        return [
            f"{t.uid}_{t.index}: finish={t.finish_reason!r} error={t.error!r} "
            f"reward={common_pb2.RewardStatus.Name(t.reward.status)} {t.reward.message!r}"
            for g in self.groups.values()
            for t in g.trajectories
            if t.tags.is_infra
        ]

    def consumed_at(self) -> dict[str, int]:
        return {
            uid: g.group.tags.consumed_step
            for uid, g in self.groups.items()
            if g.group.tags.status == GroupStatus.CONSUMED.to_proto()
        }


def audit_queue(run_dir: Path) -> Audit:
    """Restarts the run's redis-server on its AOF (on a new port) and reads every group."""
    server = RedisServer(run_dir / "redis")
    server.start()
    try:
        tq = TransferQueue(server.client(), namespace=NAMESPACE)
        snapshot = tq.audit_snapshot(PARTITION)
        tq.close()
        audit = Audit()
        for uid, group in snapshot.groups.items():
            audit.groups[uid] = group
            audit.statuses[common_pb2.GroupStatus.Name(group.group.tags.status)] += 1
        for event in snapshot.events:
            if event.kind == "group" and event.to_status == "consumed":
                audit.consume_events[event.key] += 1
        return audit
    finally:
        server.stop()


def final_step_records(run_dir: Path) -> dict[int, StepRecord]:
    """The last record of each step (a step retried after a trainer crash is logged twice)."""
    return {r.step: r for r in steps_logged(run_dir)}


def check_exactly_once(run_dir: Path, audit: Audit) -> None:
    """Every group a step trained is consumed at that step in the queue, and no group is
    trained at two steps."""
    records = final_step_records(run_dir)
    trained: dict[str, int] = {}
    for step, record in records.items():
        for uid in record.uids:
            assert uid not in trained, f"{uid} trained at steps {trained[uid]} and {step}"
            trained[uid] = step
    consumed = audit.consumed_at()
    for uid, step in trained.items():
        assert consumed.get(uid) == step, (uid, step, consumed.get(uid))
    # consumed but not trained: only groups the step judged unusable (none without the filter)
    assert set(consumed) >= set(trained)


# A series each service must export after a run (its core signal on a dashboard).
EXPECTED_SERIES = {
    "trainer": ("relayrl_trainer_completed_steps", "relayrl_trainer_step_value"),
    "gateway": ("relayrl_gateway_rollouts_total", "relayrl_gateway_throttle_max_launched_groups"),
    "reward": ("relayrl_reward_tq_trajectories_scored_total", "relayrl_reward_results_total"),
    "weightsync": (
        "relayrl_weightsync_committed_version",
        "relayrl_weightsync_boundary_duration_seconds_bucket",
    ),
    "engine-0": ("vllm:generation_tokens_total",),
}


def sample_value(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def check_short_run(run_dir: Path, mode: str, steps: int) -> None:
    """What every finished short run (SHORT_RUN) in `mode` must show: weight versions reached
    the engine, the TransferQueue consumed every trained group exactly once and marked no
    trajectory as an infrastructure failure, every service's /metrics served its series, the
    report was written and nothing is left running."""
    # weight versions advanced on the engine: every step committed, in order, and the final
    # evaluation found the engine at the last version
    transfers = read_records(run_dir / "weightsync/transfers.jsonl", TransferRecord)
    assert [t.version for t in transfers if t.state == "committed"] == list(range(1, steps + 1))
    evals = read_records(run_dir / "eval.jsonl", EvalRecord)
    assert evals[0].kind == "warm_start" and evals[0].version == 0
    assert evals[-1].kind == "final" and evals[-1].version == steps

    # the queue: every trained group consumed exactly once, at its step; nothing infra
    records = steps_logged(run_dir)
    assert [r.step for r in records] == list(range(steps))
    audit = audit_queue(run_dir)
    check_exactly_once(run_dir, audit)
    infra = audit.infra_trajectories()
    assert infra == [], "\n".join([*infra, service_warnings(run_dir)])
    assert audit.statuses["GROUP_STATUS_FAILED"] == 0, audit.statuses
    assert all(v == 1 for v in audit.consume_events.values()), audit.consume_events
    expected_staleness_max = {"sync": 1, "colocate_async": 2, "separate_async": 2}[mode]
    assert max(r.staleness_max or 0.0 for r in records) <= expected_staleness_max

    # every service served its series (scraped from its /metrics endpoint by relayrl up)
    for service, names in EXPECTED_SERIES.items():
        text = (run_dir / "metrics" / f"{service}.prom").read_text()
        for name in names:
            assert re.search(rf"^{re.escape(name)}[{{ ]", text, re.MULTILINE), (service, name)
    trainer_metrics = (run_dir / "metrics" / "trainer.prom").read_text()
    # scraped after each logged step while the trainer lives (it exits when done)
    assert 0 <= sample_value(trainer_metrics, "relayrl_trainer_completed_steps") <= steps - 1
    ws_metrics = (run_dir / "metrics" / "weightsync.prom").read_text()
    assert sample_value(ws_metrics, "relayrl_weightsync_committed_version") == steps

    # the report and the state
    assert (run_dir / "report.html").stat().st_size > 1000
    assert len(list((run_dir / "report").glob("*.png"))) >= 6
    assert RunState.read(run_dir).state == "completed"
    # shutdown left nothing behind
    assert processes_of(run_dir) == []
    assert all(c.restarts == 0 for c in stack_state(run_dir).children.values())
