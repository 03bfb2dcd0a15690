"""Running relayrl's console scripts as a user does (a fresh process, only the venv on PATH)
and checking the one-line error contract: exit code 2, one line on stderr that starts with
the program's name, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def run(
    program: str,
    *args: str | Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`program` (a console script of the venv, e.g. `relayrl`) with `args`."""
    return subprocess.run(
        [str(BIN / program), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": str(BIN), **(env or {})},
        cwd=cwd,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], prog: str, text: str) -> None:
    """`result` failed as a usage error: exit code 2 and one stderr line `<prog>: ...text...`."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: ") and text in lines[0], lines
