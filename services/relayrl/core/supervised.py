"""What a supervisor needs of a child process.

`relayrl up` (relayrl.up.supervisor) starts, watches, restarts and stops its redis-server, services
and engine through `Supervised` alone; RedisServer (relayrl.tq.server), ServiceProcess
(relayrl.core.service_process) and EngineProcess (relayrl.engine.process) have it themselves,
structurally (none of them imports this). What differs per child (how long its graceful stop
may take, whether an exit ends it for good) is the supervisor's data, not theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Supervised(Protocol):
    """One child process, tracked by PID, that can be started again on the same object after
    it exited or was stopped."""

    @property
    def pid(self) -> int | None:
        """Its process's PID; None before it is first started."""
        ...

    @property
    def log_path(self) -> Path:
        """Where its output goes."""
        ...

    def start(self, timeout_s: float) -> object:
        """Starts it and waits until it serves; raises if it exits first or is not ready in
        `timeout_s`."""
        ...

    def alive(self) -> bool: ...

    def exit_code(self) -> int | None:
        """Its exit code once it exited; None while it runs or before it is started."""
        ...

    def stop(self, timeout_s: float) -> None:
        """A graceful stop (SIGTERM), SIGKILL to what is left after `timeout_s`; idempotent."""
        ...

    def kill(self) -> None:
        """SIGKILL (a crash); idempotent."""
        ...
