"""Deprecated alias of `relayrl_testkit.judge_launcher` (the simulated judge is test harness:
the relayrl-testkit distribution, `testkit/`). Goes in the next release."""

from __future__ import annotations

import warnings

warnings.warn(
    "relayrl.reward.judge_launcher moved to relayrl_testkit.judge_launcher (the "
    "relayrl-testkit distribution: pip install -e testkit); this alias goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

from relayrl_testkit.judge_launcher import (  # noqa: E402
    LISTENING,
    JudgeSimError,
    JudgeSimProcess,
    start_judge_sim,
)

__all__ = ["LISTENING", "JudgeSimError", "JudgeSimProcess", "start_judge_sim"]
