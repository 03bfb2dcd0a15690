"""A relayrl service run as a child process: its config written to a file, its ports read
from the `--ready-file` it writes once serving, stopped by PID.

    with ServiceProcess("relayrl-reward", config, workdir) as reward:
        channel = make_channel(reward.target)

Used by the integration tests, the benchmarks and the local supervisor; stdlib and PyYAML only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml


def console_script(name: str) -> str:
    """The path of one of our console scripts: next to this interpreter (a venv), else PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed next to {sys.executable} nor on PATH")
    return found


class ServiceProcess:
    """One service process. `workdir` holds its config, ready file and log (a temporary
    directory, removed by `stop()`, when not given).

    The process leads its own process group, so that `kill()` (a crash) also takes the helper
    processes a service starts and would otherwise leave behind (the trainer's checkpoint
    writers, its local ranks), and `stop()` removes any that outlive a graceful exit."""

    def __init__(
        self,
        command: str,
        config: Mapping[str, Any],
        workdir: Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        argv: Sequence[str] = (),
    ) -> None:
        """`log_path`: where stdout and stderr go (default: `<workdir>/<command>.log`);
        `argv`: what runs the service instead of its console script (a `setpriv` wrapper,
        another interpreter), before `--config` and `--ready-file`."""
        self.command = command
        self.argv = list(argv)
        self._owns_workdir = workdir is None
        self.workdir = (workdir or Path(tempfile.mkdtemp(prefix=f"{command}-"))).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"{command}.yaml"
        self.config_path.write_text(yaml.safe_dump(dict(config)), encoding="utf-8")
        self.ready_file = self.workdir / f"{command}.ready.json"
        self.log_path = (log_path or self.workdir / f"{command}.log").absolute()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """None before `start()`."""
        return None if self.process is None else self.process.pid

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        """Start and wait until it serves (its ready file exists); raise with its log if it
        exits or does not get ready in time (and then it is killed)."""
        self.ready_file.unlink(missing_ok=True)
        argv = [
            *(self.argv or [console_script(self.command)]),
            "--config",
            str(self.config_path),
            "--ready-file",
            str(self.ready_file),
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"{self.command} exited {code}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.command} not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)
        ready = json.loads(self.ready_file.read_text(encoding="utf-8"))
        # A service without gRPC (relayrl-sandbox) has no ports to report.
        self.port, self.metrics_port = ready.get("grpc_port", 0), ready.get("metrics_port")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """Once it exited; None while it runs and before `start()`."""
        return None if self.process is None else self.process.poll()

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful stop) and wait; the exit code."""
        if self.process is None:
            raise RuntimeError(f"{self.command} is not started")
        os.kill(self.process.pid, signal.SIGTERM)
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL to the process and its group, as a crash of the machine would; idempotent."""
        if self.alive():
            os.kill(self.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            self.process.wait(30)  # type: ignore[union-attr]
        self._kill_group()

    def _kill_group(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left
            os.killpg(self.process.pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; idempotent. Removes a temporary workdir."""
        if self.alive():
            try:
                self.terminate(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._kill_group()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
