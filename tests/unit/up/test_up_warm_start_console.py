"""What `relayrl up` says while the warm start runs, read from the SFT process's log
(`relayrl.up.prepare._wait_reporting_epochs`): each epoch's loss and sampled accuracy, and the
update at which the target was reached."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from relayrl.up.prepare import _wait_reporting_epochs


def test_the_warm_start_console_says_each_epoch_and_where_the_target_was_reached(
    tmp_path: Path,
) -> None:
    log = tmp_path / "sft.log"
    log.write_text(
        "2026-12-07 INFO sft update 4 (epoch 1): eval accuracy 0.0100, lr 0.001\n"
        "2026-12-07 INFO sft update 8 (end of epoch 1): eval accuracy 0.0900, lr 0.001\n"
        "2026-12-07 INFO sft epoch 1: loss 2.5000, eval accuracy 0.0900, lr 0.001\n"
        "2026-12-07 INFO sft update 12 (epoch 2): eval accuracy 0.1612, lr 0.001\n"
        "2026-12-07 INFO sft epoch 2: loss 1.2500, eval accuracy 0.1612, lr 0.001\n"
        "2026-12-07 INFO sft: eval accuracy 0.1612 reached the target 0.1500 at update 12: "
        "stopping\n"
    )
    said: list[str] = []
    done = subprocess.Popen(["true"])
    assert _wait_reporting_epochs(done, log, 12, time.monotonic(), said.append) == 0
    assert [line.rsplit(" (", 1)[0] for line in said] == [
        "warm start: epoch 1/12, loss 2.500, sampled accuracy 9.0%",
        "warm start: epoch 2/12, loss 1.250, sampled accuracy 16.1%",
        "warm start: a sample answers 16.1% after update 12: target reached",
    ]
