"""The NCCL data plane on real GPUs (bench/nccl_check.py): one sender and two receivers, each on
its own GPU, against the device-to-device copy bandwidth. Runs only where 3 CUDA devices are
visible; tests/integration/weightsync/test_weightsync_nccl_check_script.py runs the same script
over gloo here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 3,
        reason="needs 3 CUDA GPUs (NCCL puts one rank on one GPU)",
    ),
]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "nccl_check.py"


@pytest.mark.timeout(600)
def test_the_nccl_check_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=550
    )
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and last.endswith("ok=true"), result.stdout + result.stderr
