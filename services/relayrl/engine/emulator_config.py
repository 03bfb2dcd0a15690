"""Deprecated alias of `relayrl_testkit.emulator_config` (the engine emulator is test harness:
the relayrl-testkit distribution, `testkit/`). Goes in the next release."""

from __future__ import annotations

import warnings

warnings.warn(
    "relayrl.engine.emulator_config moved to relayrl_testkit.emulator_config (the "
    "relayrl-testkit distribution: pip install -e testkit); this alias goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

from relayrl_testkit.emulator_config import (  # noqa: E402
    DESCRIPTION,
    PROG,
    EmulatorConfig,
    build_parser,
    fail,
    parse_config,
)

__all__ = ["DESCRIPTION", "PROG", "EmulatorConfig", "build_parser", "fail", "parse_config"]
