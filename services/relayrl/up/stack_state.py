"""`<run_dir>/stack.json`: the processes of a running `relayrl up`, one typed object.

relayrl.up.supervisor writes it whenever a child starts, restarts or stops; `relayrl status`,
`relayrl logs`' liveness check, the test kit (PIDs to signal, targets to knock on, the hosts
to cut apart) and the benches read it. Every reader gets a `StackState`, or `StackStateError`
naming the file and the field, as for run.json (relayrl.up.run_state).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from relayrl.core.atomic import atomic_write_text
from relayrl.up.run_state import read_model

STACK_FILE = "stack.json"


class StackStateError(ValueError):
    """A stack.json that cannot be read as a stack's state; the message starts with its path."""


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ChildState(_State):
    """One child process as the supervisor last saw it."""

    pid: int | None
    restarts: int = 0
    url: str | None = None  # redis and the engines: what a client opens
    target: str | None = None  # a gRPC service: host:port
    metrics: str | None = None  # a service's /metrics URL
    netns: str | None = None  # with hosts.isolate: the network namespace it runs in


class PartHost(_State):
    netns: str
    address: str
    veth: str  # the root namespace's end of its veth pair


class HostsState(_State):
    """The hosts of a run with `hosts.isolate` (relayrl.up.hosts.HostNetwork)."""

    tag: str
    subnet: str
    bridge: str
    bridge_address: str
    parts: dict[str, PartHost]


class StackState(_State):
    redis_url: str  # without the run's password (relayrl.up.secrets.with_redis_password)
    namespace: str
    partition: str
    engines: list[str]
    children: dict[str, ChildState]
    written: float
    hosts: HostsState | None = None

    def pid(self, child: str) -> int | None:
        """The PID recorded for `child` (`trainer`, `engine-0`, ...), if it has one."""
        state = self.children.get(child)
        return None if state is None else state.pid

    def pids(self) -> list[int]:
        return [c.pid for c in self.children.values() if c.pid]

    def write(self, run_dir: Path) -> None:
        atomic_write_text(run_dir / STACK_FILE, self.model_dump_json(indent=2) + "\n")

    @staticmethod
    def exists(run_dir: Path) -> bool:
        return (run_dir / STACK_FILE).is_file()

    @classmethod
    def read(cls, run_dir: Path) -> StackState:
        """The stack's state; FileNotFoundError when the run has none, StackStateError when
        what is there is not one."""
        return read_model(run_dir / STACK_FILE, cls, StackStateError)

    @classmethod
    def read_if_any(cls, run_dir: Path) -> StackState | None:
        """The stack's state, or None before the supervisor first wrote it."""
        return cls.read(run_dir) if cls.exists(run_dir) else None
