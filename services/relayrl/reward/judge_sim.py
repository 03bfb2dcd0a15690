"""Deprecated alias of `relayrl_testkit.judge_sim`: the simulated vLLM judge is test harness and
lives in the relayrl-testkit distribution (`testkit/`, installed by `make setup`; never in a
service image). `python -m relayrl.reward.judge_sim` still runs it, with a warning. Goes in the
next release."""

from __future__ import annotations

import warnings

_MOVED = (
    "relayrl.reward.judge_sim moved to relayrl_testkit.judge_sim (the relayrl-testkit "
    "distribution: pip install -e testkit); this alias goes in the next release"
)
if __name__ != "__main__":
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)

from relayrl_testkit.judge_sim import (  # noqa: E402
    BODY_FAULTS,
    FAULT_HEADER,
    MATCH_PROB,
    REQUEST_LOG_MAX,
    SCORING_ENDPOINTS,
    TAG_CHARS,
    DecodeEngine,
    FaultPlan,
    Judgement,
    JudgeSim,
    SimOptions,
    SimStats,
    approx_tokens,
    is_fault_kind,
    item_tag,
    judge,
    main,
    parse_args,
    serve,
)

__all__ = [
    "BODY_FAULTS",
    "FAULT_HEADER",
    "MATCH_PROB",
    "REQUEST_LOG_MAX",
    "SCORING_ENDPOINTS",
    "TAG_CHARS",
    "DecodeEngine",
    "FaultPlan",
    "JudgeSim",
    "Judgement",
    "SimOptions",
    "SimStats",
    "approx_tokens",
    "is_fault_kind",
    "item_tag",
    "judge",
    "main",
    "parse_args",
    "serve",
]

if __name__ == "__main__":
    # Attributed to __main__, so Python shows it by default.
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=1)
    main()
