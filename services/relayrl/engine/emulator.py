"""Deprecated alias of `relayrl_testkit.emulator`: the engine emulator is test harness and lives
in the relayrl-testkit distribution (`testkit/`, installed by `make setup`; never in a service
image). `python -m relayrl.engine.emulator` still runs it, with a warning. Goes in the next
release."""

from __future__ import annotations

import sys
import warnings

_MOVED = (
    "relayrl.engine.emulator moved to relayrl_testkit.emulator (the relayrl-testkit "
    "distribution: pip install -e testkit); this alias goes in the next release"
)
if __name__ != "__main__":
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)

from relayrl_testkit.emulator import (  # noqa: E402
    MAX_BODY_BYTES,
    PAUSE_MODES,
    RPC_METHODS,
    BadRequest,
    EmulatedEngine,
    EmulatedWorker,
    EmulatorApp,
    EmulatorMetrics,
    Finished,
    GenerateBody,
    RequestLog,
    StartupError,
    VirtualClock,
    emitted_tokens,
    generate_answer,
    main,
    parse_generate_body,
    serve,
    version_spans,
    write_ready_file,
)
from relayrl_testkit.emulator_config import EmulatorConfig, parse_config  # noqa: E402

__all__ = [
    "MAX_BODY_BYTES",
    "PAUSE_MODES",
    "RPC_METHODS",
    "BadRequest",
    "EmulatedEngine",
    "EmulatedWorker",
    "EmulatorApp",
    "EmulatorConfig",
    "EmulatorMetrics",
    "Finished",
    "GenerateBody",
    "RequestLog",
    "StartupError",
    "VirtualClock",
    "emitted_tokens",
    "generate_answer",
    "main",
    "parse_config",
    "parse_generate_body",
    "serve",
    "version_spans",
    "write_ready_file",
]

if __name__ == "__main__":
    # Attributed to __main__, so Python shows it by default.
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=1)
    sys.exit(main())
