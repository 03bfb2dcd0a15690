"""Start `relayrl_testkit.judge_sim` as a child process on a free loopback port, talk to its
control endpoints, and stop it by PID. Shared by the judge tests and the reward benchmarks
(`from relayrl_testkit.judge_launcher import start_judge_sim`), so it uses only the standard
library.

    with start_judge_sim(step_s=0.001, verdict_tokens=5, prefill_s=0.01) as sim:
        ... sim.url ...
        assert sim.stats()["requests"] == 1
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

LISTENING = "judge_sim listening on "
# Loopback only: never through an HTTP(S)_PROXY from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class JudgeSimError(RuntimeError):
    pass


class JudgeSimProcess:
    """One running judge_sim. `url` is its base URL (http://127.0.0.1:PORT)."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def request(self, method: str, path: str, body: Any = None, timeout_s: float = 30.0) -> Any:
        """One JSON request to the simulator (no proxy); the decoded answer, None if empty.
        An HTTP error status raises urllib.error.HTTPError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with _OPENER.open(request, timeout=timeout_s) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def stats(self) -> dict[str, Any]:
        """The server's counters (see the judge_sim module docstring for the fields)."""
        return self.request("GET", "/stats")

    def reset_stats(self) -> None:
        self.request("POST", "/stats/reset", {})

    def set_fault(
        self, kind: str | None, count: int = 0, retry_after_s: float | None = None
    ) -> None:
        """Make the next `count` scoring requests (0: all) fail with `kind`; None clears."""
        body: dict[str, Any] = {"fault": kind, "count": count}
        if retry_after_s is not None:
            body["retry_after_s"] = retry_after_s
        self.request("POST", "/control", body)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (graceful), SIGKILL if it is still there after `timeout_s`. Idempotent."""
        process = self.process
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> JudgeSimProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _flags(options: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False or value is None:
            continue
        else:
            args += [flag, str(value)]
    return args


def start_judge_sim(
    *, timeout_s: float = 20.0, python: str = sys.executable, **options: Any
) -> JudgeSimProcess:
    """Start a judge_sim on 127.0.0.1 with a free port and wait until it accepts requests.

    `options` are the simulator's flags with underscores (`step_s=0.001`, `verdict_tokens=5`,
    `time_scale=0.1`, `fault="500"`, `access_log=True`); stderr goes to a temporary log file
    (`.log()`), removed by `stop()`."""
    fd, log_name = tempfile.mkstemp(prefix="judge_sim-", suffix=".log")
    log_path = Path(log_name)
    command = [python, "-m", "relayrl_testkit.judge_sim", "--host", "127.0.0.1", "--port", "0"]
    with os.fdopen(fd, "wb") as log_file:
        process = subprocess.Popen(
            [*command, *_flags(options)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
        )
    sim = JudgeSimProcess(process, "", log_path)
    try:
        sim.url = _read_url(process, timeout_s)
        sim.request("GET", "/health")
    except BaseException as exc:
        log = sim.log()
        sim.stop()  # never leave a half-started server behind
        if isinstance(exc, JudgeSimError):
            raise JudgeSimError(f"{exc}; its stderr:\n{log}") from None
        raise
    return sim


def _read_url(process: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    buffered = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in buffered:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JudgeSimError(f"judge_sim did not announce its port in {timeout_s}s")
            if not selector.select(left):
                continue
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                raise JudgeSimError(f"judge_sim exited at start (code {process.wait()})")
            buffered += chunk
    line = buffered.split(b"\n", 1)[0].decode()
    if not line.startswith(LISTENING):
        raise JudgeSimError(f"judge_sim printed {line!r}, not its listening line")
    return line[len(LISTENING) :].strip()
