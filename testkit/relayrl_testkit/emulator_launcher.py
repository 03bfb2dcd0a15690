"""Start the engine emulator (`python -m relayrl_testkit.emulator`) as a child process on a
free loopback port, read its request log and metrics, and stop it by PID.

    emulator = start_emulator(workdir, seed=0, time_scale=0.01)
    try:
        ... VllmEngineClient(emulator.url) ...
    finally:
        emulator.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Emulator:
    """One running emulator: its base URL, request log (JSON lines), output and seed."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    output: Path
    seed: int

    def records(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]

    def metric(self, name: str) -> float:
        text = _NO_PROXY.open(self.url + "/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics:\n{text}")

    def stop(self) -> int:
        """SIGTERM by PID (SIGKILL after 15 s); the exit code."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(15)
        return self.process.returncode


def start_emulator(
    workdir: Path,
    *,
    seed: int,
    time_scale: float,
    sync_time_s: float = 10.0,
    vocab_size: int = VOCAB_SIZE,
    env: Mapping[str, str] | None = None,
) -> Emulator:
    """An emulator on a free loopback port, ready (its ready file written); its request log
    (`records()`) and output in `workdir`. `env` is added to its environment (e.g. the
    engine's TLS towards weight-sync, as the launcher passes it to workers)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready, log, output = workdir / "ready.json", workdir / "requests.jsonl", workdir / "out.log"
    argv = [
        sys.executable, "-m", "relayrl_testkit.emulator",
        "--port", "0", "--ready-file", str(ready), "--log", str(log),
        "--seed", str(seed), "--time-scale", repr(time_scale),
        "--sync-time-s", repr(sync_time_s), "--vocab-size", str(vocab_size),
    ]  # fmt: skip
    with output.open("wb") as sink:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait(10)
            raise AssertionError(f"the emulator did not start:\n{output.read_text()}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    assert info["pid"] == process.pid
    return Emulator(process, info["url"], log, output, seed)
