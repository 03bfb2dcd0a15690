"""RetryPolicy bounds: validation and exponential, capped, jittered backoff."""

from __future__ import annotations

import random

import grpc
import pytest

from relayrl.core.grpc_client import RetryPolicy


def test_default_retries_only_unavailable() -> None:
    assert RetryPolicy().retryable_codes == frozenset({grpc.StatusCode.UNAVAILABLE})


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5, jitter=False)
    assert [policy.backoff_s(i) for i in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_jitter_stays_within_half_to_full_backoff() -> None:
    policy = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=1.0)
    rng = random.Random(0)
    delays = [policy.backoff_s(0, rng) for _ in range(200)]
    assert all(0.5 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 1


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"initial_backoff_s": 0}, "initial_backoff_s"),
        ({"initial_backoff_s": 2.0, "max_backoff_s": 1.0}, "initial_backoff_s <= max_backoff_s"),
        ({"backoff_multiplier": 0.5}, "backoff_multiplier"),
    ],
)
def test_invalid_policies_are_refused(fields: dict[str, float], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        RetryPolicy(**fields)  # type: ignore[arg-type]
