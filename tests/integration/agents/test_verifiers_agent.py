"""examples/agents/verifiers_agent.py in the verifiers virtual environment `make setup` builds:
the export, finding a sample's task, the rubric's reward and the environment's errors reported
with the close, the renewal of verifiers' serving resources, and one-line refusals
(verifiers_agent_checks.py, run with that environment's interpreter)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VERIFIERS_PYTHON = REPO / ".venv" / "share" / "venvs" / "verifiers" / "bin" / "python"
CHECKS = Path(__file__).with_name("verifiers_agent_checks.py")


@pytest.mark.timeout(300)
def test_the_verifiers_adapter_in_its_own_environment() -> None:
    assert VERIFIERS_PYTHON.exists(), f"{VERIFIERS_PYTHON}: run make setup"
    done = subprocess.run(
        [str(VERIFIERS_PYTHON), str(CHECKS)], capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    checks = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(checks) >= 22, output  # every check ran
