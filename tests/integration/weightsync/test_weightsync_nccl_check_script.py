"""bench/nccl_check.py, the prepared NCCL check, run here over gloo (`--device cpu`): the same
harness (a sender and two receiver processes on the torch_distributed transport) that it runs
on GPUs, so the script a GPU session runs is known to work. The NCCL run is
tests/gpu/test_gpu_nccl_check.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "nccl_check.py"


def test_the_check_script_moves_every_bucket_over_gloo() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--gib", "0.125", "--bucket-mib", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert "gloo: " in lines[-2] and "8 buckets" in lines[-2], result.stdout
    assert re.fullmatch(r"nccl-check: gbps=\d+\.\d\d d2d_gbps=nan ratio=nan ok=true", lines[-1]), (
        result.stdout
    )
