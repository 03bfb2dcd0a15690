"""The supervisor of `relayrl up` drives the process classes themselves through `Supervised`,
and what differs per child is data (`ChildSpec`) given when the stack builds it, never a
branch on a child's name. Nothing is started here: the children are built, or stand-ins."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path

from relayrl.core.service_process import ServiceProcess
from relayrl.core.supervised import Supervised
from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.stack.local import LocalPorts
from relayrl.tq.server import RedisServer
from relayrl.trainer.progress import EXIT_NO_PROGRESS
from relayrl.up.config import UpConfig
from relayrl.up.prepare import RunFiles
from relayrl.up.stack_state import ChildState, StackState
from relayrl.up.supervisor import ORDER, ChildSpec, Supervisor


def a_stack(tmp_path: Path, **supervision: float) -> Supervisor:
    config = UpConfig.model_validate(
        {
            "supervision": supervision,
            "placement": {"auto": False},
            "security": {"authenticate": False},
        }
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    return Supervisor(
        config, run_dir, tmp_path / "model", RunFiles.in_dir(tmp_path), LocalPorts.placeholder()
    )


def test_each_process_class_is_supervised_and_has_no_process_before_it_starts(
    tmp_path: Path,
) -> None:
    children = [
        RedisServer(tmp_path / "redis"),
        ServiceProcess("relayrl-reward", {}, tmp_path / "reward"),
        EngineProcess(EngineConfig(model=tmp_path, port=20001), tmp_path / "engine"),
    ]
    for child in children:
        assert isinstance(child, Supervised), type(child).__name__
        for method in ("start", "stop"):  # the supervisor passes timeout_s by name
            assert "timeout_s" in inspect.signature(getattr(child, method)).parameters
        assert child.pid is None and child.exit_code() is None and not child.alive()
        assert isinstance(child.log_path, Path)
        child.stop(timeout_s=1.0)  # nothing to stop: no-ops
        child.kill()


def test_the_stack_holds_the_process_classes_and_each_childs_data(tmp_path: Path) -> None:
    stack = a_stack(tmp_path)
    stack.build()
    assert list(stack.children) == [
        "redis",
        "reward",
        "gateway",
        "weightsync",
        "trainer",
        "engine-0",
    ]
    assert sorted(stack.specs) == sorted(ORDER)
    assert type(stack.children["redis"]) is RedisServer
    assert type(stack.children["trainer"]) is ServiceProcess
    assert type(stack.children["engine-0"]) is EngineProcess
    assert all(isinstance(child, Supervised) for child in stack.children.values())

    specs = stack.specs
    # the trainer checkpoints on SIGTERM; its exit 0 (done) and 3 (a stop rule) end it for good
    assert specs["trainer"].stop_timeout_s == 120.0
    assert specs["trainer"].done_exit_codes == {0, EXIT_NO_PROGRESS}
    others = [name for name in ORDER if name != "trainer"]
    assert all(specs[name].done_exit_codes == frozenset() for name in others)
    assert specs["redis"].stop_timeout_s == 10.0 and specs["redis"].start_timeout(300.0) == 120.0
    assert specs["reward"].start_timeout(300.0) == 300.0
    assert [name for name in ORDER if specs[name].routes_to_engines] == ["gateway"]
    assert list(stack.engines()) == ["engine-0"]

    stack.write_state()
    shown = StackState.read(stack.run_dir).children
    assert shown["redis"] == ChildState(pid=None, url=stack.redis_url)
    assert shown["engine-0"] == ChildState(pid=None, url=stack.engine_url)
    assert shown["trainer"] == ChildState(
        pid=None, target=stack.target("trainer"), metrics=stack.metrics_url("trainer")
    )


class StandIn:
    """A `Supervised` that runs nothing: `exit(code)` is its process ending."""

    def __init__(self, log_path: Path, stops: list[tuple[str, float]], name: str) -> None:
        self.log_path, self.stops, self.name = log_path, stops, name
        self.pid: int | None = None
        self.code: int | None = None
        self.starts: list[float] = []

    def start(self, timeout_s: float) -> None:
        self.starts.append(timeout_s)
        self.pid, self.code = 1000 + len(self.starts), None

    def alive(self) -> bool:
        return self.pid is not None and self.code is None

    def exit_code(self) -> int | None:
        return self.code

    def stop(self, timeout_s: float) -> None:
        self.stops.append((self.name, timeout_s))
        if self.alive():
            self.code = -15

    def kill(self) -> None:
        self.code = -9


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_whether_an_exit_ends_a_child_is_its_data_not_its_name(tmp_path: Path) -> None:
    stack = a_stack(tmp_path, restart_backoff_s=0.0, max_restarts=1, start_timeout_s=300.0)
    stops: list[tuple[str, float]] = []
    redis, reward, trainer = (
        StandIn(tmp_path / f"{name}.log", stops, name) for name in ("redis", "reward", "trainer")
    )
    assert all(isinstance(child, Supervised) for child in (redis, reward, trainer))
    # swapped on purpose: a "reward" whose exit 0 is final, a "trainer" restarted on any exit
    stack.children = {"redis": redis, "reward": reward, "trainer": trainer}
    stack.specs = {
        "redis": ChildSpec(stop_timeout_s=10.0, max_start_timeout_s=120.0),
        "reward": ChildSpec(stop_timeout_s=7.0, done_exit_codes=frozenset({0})),
        "trainer": ChildSpec(stop_timeout_s=5.0),
    }
    lines: list[str] = []
    stack.start(("redis", "reward", "trainer"), say=lines.append)
    assert redis.starts == [120.0] and reward.starts == [300.0] and trainer.starts == [300.0]
    assert len(lines) == 3

    stack.supervise()
    reward.code = trainer.code = 0
    until(lambda: len(trainer.starts) == 2)
    assert stack.restarts["trainer"] == 1
    trainer.code = 1  # a second exit: max_restarts is 1
    until(lambda: stack.failed)
    assert reward.starts == [300.0] and stack.restarts["reward"] == 0
    assert stack.failure.startswith("trainer exited (code 1) 2 times; giving up")
    kinds = [(e.child, e.kind) for e in stack.events]
    assert ("reward", "exited") not in kinds
    assert kinds[-4:] == [
        ("trainer", "exited"),
        ("trainer", "restarted"),
        ("trainer", "exited"),
        ("trainer", "gave_up"),
    ]
    shown = StackState.read(stack.run_dir).children
    assert shown["trainer"].pid == 1002 and shown["trainer"].restarts == 1

    stack.stop(say=lines.append)
    assert stops == [("trainer", 5.0), ("reward", 7.0), ("redis", 10.0)]  # the trainer first
    assert [(e.child, e.kind) for e in stack.events][-1] == ("redis", "stopped")
