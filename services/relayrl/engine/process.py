"""An engine replica as a child process (`python -m relayrl.engine`), for tests, benchmarks
and the local supervisor: started on a free loopback port, ready when /health answers,
stopped by PID.

The engine runs in its own session (process group) because vLLM may start helper processes
(an engine core, a resource tracker) that outlive a signal sent to the server alone; stopping
signals the server first, then whatever is left in its group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import yaml

from relayrl.core.ports import free_port
from relayrl.engine.config import EngineConfig

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        workdir: Path,
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        """`env`: variables added to this process's environment for the engine's; `log_path`:
        where its output goes (default: `<workdir>/engine.log`)."""
        if config.port == 8000:  # the default: pick a free one instead
            config = config.model_copy(update={"port": free_port(config.host)})
        self.config = config
        self.workdir = workdir = workdir.absolute()
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "engine.yaml"
        self.config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        self.log_path = (log_path or workdir / "engine.log").absolute()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        self._env = {**os.environ, **env} if env else None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def pid(self) -> int | None:
        """None before `spawn()`."""
        return None if self.process is None else self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """Once it exited; None while it runs and before `spawn()`."""
        return None if self.process is None else self.process.poll()

    def start(self, timeout_s: float = 300.0) -> EngineProcess:
        """Starts the engine and waits until it serves (`spawn`, then `wait_ready`)."""
        return self.spawn().wait_ready(timeout_s)

    def spawn(self) -> EngineProcess:
        """Starts the engine process without waiting for it to serve."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "relayrl.engine", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self._env,
            )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> EngineProcess:
        """Until the spawned engine answers /health; raises with its log if it exits first or
        does not get ready in `timeout_s` (it is then killed)."""
        if self.process is None:
            raise RuntimeError("the engine is not spawned")
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"engine exited {self.process.returncode}:\n{self.log()[-5000:]}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"engine not ready in {timeout_s} s:\n{self.log()[-5000:]}")
            time.sleep(0.25)
        return self

    def _healthy(self) -> bool:
        try:
            with _NO_PROXY.open(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL to the engine and its helpers, as a crashed pod; idempotent."""
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        self.process.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a graceful stop), then SIGKILL to anything left in its group; idempotent."""
        if self.process is None:
            return
        if self.alive():
            os.kill(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        self.kill()

    def _signal_group(self, signum: signal.Signals) -> None:
        # The group id is the server's PID (start_new_session); it outlives the server while
        # any helper of it runs.
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
