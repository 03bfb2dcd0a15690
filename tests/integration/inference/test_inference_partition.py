"""A generation waiting on an engine whose network went (packets dropped, nothing closed or
reset) fails as the engine's within the connection's TCP keepalive bound, not at the
generation's deadline (docs/recovery.md#silent-peers)."""

from __future__ import annotations

import pytest

from relayrl_testkit.helpers.partition import partition_unavailable, run_partitioned

SLACK_S = 1.5


def test_a_partition_under_a_long_generation_fails_it_within_the_keepalive_bound() -> None:
    why = partition_unavailable()
    if why:
        pytest.skip(why)
    outcome = run_partitioned("engine-generate")
    assert outcome["error"].startswith("EngineUnavailable"), outcome
    assert outcome["noticed_after_s"] < outcome["bound_s"] + SLACK_S, outcome
