"""The console scripts, run as real processes: help, config checking, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TrajectoryPut, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers import cli
from relayrl_testkit.helpers.cli import assert_one_line_error

SERVICES = ["relayrl-gateway", "relayrl-reward", "relayrl-trainer", "relayrl-weightsync"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli.run(*args, env=env, timeout=60)


@pytest.mark.parametrize("prog", SERVICES)
def test_service_help_and_config(prog: str, tmp_path: Path) -> None:
    assert run(prog, "--help").returncode == 0
    config = tmp_path / "c.yaml"
    config.write_text("grpc:\n  port: 50999\nlogging:\n  level: debug\n")
    prefix = prog.upper().replace("-", "_")
    shown = run(prog, "--config", str(config), "--print-config", env={f"{prefix}__GRPC__HOST": "0"})
    assert shown.returncode == 0, shown.stderr
    assert "port: 50999" in shown.stdout and "host: '0'" in shown.stdout
    assert "level: DEBUG" in shown.stdout


@pytest.mark.parametrize("prog", SERVICES)
def test_service_config_mistakes_are_one_line(prog: str, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("grpc:\n  port: 70000\n")
    assert_one_line_error(run(prog, "--config", str(config)), prog, "grpc.port")
    config.write_text("grcp: {}\n")
    assert_one_line_error(run(prog, "--config", str(config)), prog, "grcp")
    missing = run(prog, "--config", str(tmp_path / "nope.yaml"))
    assert_one_line_error(missing, prog, "nope.yaml")


def test_up_checks_its_flags_before_starting_anything(tmp_path: Path) -> None:
    """(The whole run is tested in tests/integration/up.)"""
    assert_one_line_error(
        run("relayrl", "up", "--mode", "sync", "--eta", "2", "--runs-dir", str(tmp_path)),
        "relayrl up",
        "mode sync needs eta 0",
    )
    assert_one_line_error(
        run("relayrl", "up", "--resume", str(tmp_path)), "relayrl up", "is not a relayrl run"
    )
    printed = run("relayrl", "up", "--steps", "7", "--print-config")
    assert printed.returncode == 0 and "steps: 7" in printed.stdout, printed.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was started or written


def test_tq_counts_and_events(redis_server: RedisServer) -> None:
    tq = TransferQueue(redis_server.client(), namespace="run7")
    tq.create_partition("train")
    tq.put_groups(
        "train",
        [
            common_pb2.PromptGroup(uid=f"g{i}", num_samples=1, prompt_token_ids=[1])
            for i in range(3)
        ],
    )
    claim = tq.claim_groups("train", max_groups=1, claimer="t", lease_s=60).claimed[0]
    traj = common_pb2.Trajectory(uid=claim.group.uid, index=0, response_token_ids=[2])
    traj.response_mask = b"\x01"
    tq.put_trajectories("train", [TrajectoryPut(traj, claim.claim_id)])
    url = redis_server.url
    counts = run("relayrl", "tq", "--url", url, "--namespace", "run7", "counts")
    assert counts.returncode == 0, counts.stderr
    assert "train: groups pending=2 running=0 finished=1" in counts.stdout
    assert "trajectories finished=1" in counts.stdout and "launched=1" in counts.stdout
    events = run("relayrl", "tq", "--url", url, "--namespace", "run7", "events", "train", "-n", "2")
    assert events.returncode == 0, events.stderr
    assert events.stdout.splitlines()[-1].endswith("group g0 running -> finished")
    unknown = run("relayrl", "tq", "--url", url, "--namespace", "run7", "events", "nope")
    assert_one_line_error(unknown, "relayrl tq events", "no partition 'nope'")


def test_tq_unreachable_redis_is_one_line(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")  # a free port nobody listens on
    result = run("relayrl", "tq", "--url", server.url, "counts")
    assert_one_line_error(result, "relayrl tq", "unavailable")


@pytest.mark.parametrize(
    "module",
    ["relayrl.cli", *(f"relayrl.{s}.cli" for s in ("gateway", "reward", "trainer", "weightsync"))],
)
def test_help_imports_nothing_heavy(module: str) -> None:
    """`--help` must answer at once: no pydantic, redis, protobuf (let alone torch) imported."""
    probe = (
        "import sys\n"
        f"from {module} import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('pydantic', 'redis', 'google.protobuf', 'torch', 'yaml')"
        " if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"
