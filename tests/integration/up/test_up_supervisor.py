"""The supervisor of `relayrl up` with real processes and no model: a redis-server and two
stand-in services (a few lines of Python that write their ready file), driven through the
process classes themselves. A crashed child comes back with a new PID, the trainer's exit 0
is final, and `stop()` stops what runs, the trainer first and Redis last."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from relayrl.core.service_process import ServiceProcess
from relayrl.stack.local import LocalPorts
from relayrl.tq.server import RedisServer
from relayrl.up.config import UpConfig
from relayrl.up.prepare import RunFiles
from relayrl.up.stack_state import ChildState, StackState
from relayrl.up.supervisor import REDIS, SERVICE, SERVICE_SPECS, Supervisor

# Serves until `<workdir>/exit` holds an exit code.
STAND_IN = """
import json, pathlib, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
workdir, ready = pathlib.Path(args["--config"]).parent, pathlib.Path(args["--ready-file"])
ready.with_suffix(".tmp").write_text(json.dumps({"grpc_port": 0}))
ready.with_suffix(".tmp").replace(ready)
while not (workdir / "exit").exists():
    time.sleep(0.05)
sys.exit(int((workdir / "exit").read_text()))
"""


def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_crashed_children_come_back_the_trainers_exit_0_is_final_and_stop_goes_in_order(
    tmp_path: Path,
) -> None:
    config = UpConfig.model_validate(
        {"supervision": {"restart_backoff_s": 0.0, "max_restarts": 2}, "placement": {"auto": False}}
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    ports = LocalPorts.choose()
    redis = RedisServer(run_dir / "redis", port=ports.redis)
    services = {
        name: ServiceProcess(
            f"relayrl-{name}",
            {},
            run_dir / "services" / name,
            log_path=run_dir / "logs" / f"{name}.log",
            argv=[sys.executable, "-c", STAND_IN],
        )
        for name in ("reward", "trainer")
    }
    stack = Supervisor(
        config, run_dir, tmp_path / "model", RunFiles.in_dir(tmp_path), ports,
        children={"redis": redis, **services},
        specs={
            "redis": replace(REDIS, shown={"url": redis.url}),
            **{name: SERVICE_SPECS.get(name, SERVICE) for name in services},
        },
    )  # fmt: skip
    reward, trainer = services["reward"], services["trainer"]
    lines: list[str] = []
    stack.start(("redis", "reward", "trainer"), say=lines.append)
    state = StackState.read(run_dir).children
    assert state["redis"] == ChildState(pid=redis.pid, restarts=0, url=redis.url)
    assert state["trainer"].pid == trainer.pid

    def events() -> list[tuple[str, str]]:
        return [(e.child, e.kind) for e in stack.events]

    stack.supervise()
    try:
        first = redis.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)  # a crash: its exit is seen through RedisServer itself
        until(lambda: ("redis", "restarted") in events())
        assert redis.alive() and redis.pid != first and redis.client().ping()

        first = reward.pid
        reward.kill()
        until(lambda: ("reward", "restarted") in events())
        assert reward.alive() and reward.pid != first

        (run_dir / "services" / "trainer" / "exit").write_text("0")
        until(lambda: trainer.exit_code() == 0)
        time.sleep(1.5)  # three rounds of the watcher
        assert ("trainer", "exited") not in events() and not trainer.alive()
        assert not stack.failed
        assert stack.restarts == {"redis": 1, "reward": 1}
        state = StackState.read(run_dir).children
        assert state["reward"].restarts == 1 and state["reward"].pid == reward.pid
    finally:
        pids = [p for p in (redis.pid, reward.pid, trainer.pid) if p is not None]
        stack.stop(say=lines.append)
    assert [e for e in events() if e[1] == "stopped"] == [
        ("reward", "stopped"),
        ("redis", "stopped"),
    ]
    assert not any(psutil.pid_exists(pid) for pid in pids)
    state = StackState.read(run_dir).children
    assert state["redis"].pid is None and state["redis"].restarts == 1
