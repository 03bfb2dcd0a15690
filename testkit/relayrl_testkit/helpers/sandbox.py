"""relayrl-sandbox as the chart runs it, for tests and benchmarks: root with only the
capabilities the sandbox needs (setpriv), and callers under uids of their own."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.core.service_process import ServiceProcess, console_script

# What the chart's sandbox container adds back after dropping ALL (docs/security.md).
SANDBOX_CAPS = ("sys_admin", "setuid", "setgid", "kill", "chown", "dac_override", "fowner")
# An interpreter other uids can run: the venv's lives under /root, which they cannot enter.
DEBIAN_PYTHON = "/usr/bin/python3.11"

# (a refused caller is answered before its request is read: the send may fail, the answer not)
_SUBMIT = """
import contextlib, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
with contextlib.suppress(BrokenPipeError, ConnectionResetError):
    s.sendall(sys.argv[2].encode() + b"\\n")
print(s.makefile().readline())
"""


def sandbox_argv() -> list[str]:
    bounding = "-all," + ",".join(f"+{cap}" for cap in SANDBOX_CAPS)
    script = console_script("relayrl-sandbox")
    return ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", script]


def start_sandbox(
    workdir: Path, socket: Path, allow_uids: Sequence[int], **sandbox: Any
) -> ServiceProcess:
    """A running relayrl-sandbox listening on `socket` (its directory must exist)."""
    config = {"socket": str(socket), "allow_uids": list(allow_uids), "sandbox": sandbox}
    return ServiceProcess("relayrl-sandbox", config, workdir, argv=sandbox_argv()).start()


def submit_as(uid: int, socket: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Send one request to the sandbox as another uid; its reply (or {"status": "closed"})."""
    result = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", DEBIAN_PYTHON,
         "-c", _SUBMIT, str(socket), json.dumps(request)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    line = result.stdout.strip()
    return json.loads(line) if line else {"status": "closed", "stderr": result.stderr[-500:]}
