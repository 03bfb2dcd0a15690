"""The trainer's step on one GPU against bare PyTorch on that GPU (bench/gpu_trainer_check.py):
SmolLM2 in bf16 through relayrl.trainer and through transformers, same rows, same
micro-batches. Runs only where a CUDA device is visible; the ratio and MFU it prints are
figures for the closing note, not assertions (a timed assertion fails on a busy device)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_trainer_check.py"


@pytest.mark.timeout(1500)
def test_the_trainer_step_runs_on_the_gpu_and_matches_the_reference_log_probs() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "2"], capture_output=True, text=True,
        timeout=1400,
    )  # fmt: skip
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout + result.stderr
    assert last.startswith("gpu-trainer-check: trainer_vs_torch=") and last.endswith("ok=true")
