"""The GPU path of "train your own model" (bench/gpu_real_model_check.py): SmolLM2 in bf16
through megatron-core on CUDA, and a short `relayrl up` with vLLM on CUDA and weight-sync over
NCCL. Runs only where a CUDA device is visible."""

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

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_real_model_check.py"


@pytest.mark.timeout(2400)
def test_the_gpu_check_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3"], capture_output=True, text=True, timeout=2300
    )
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and last.endswith("ok=true"), result.stdout + result.stderr
