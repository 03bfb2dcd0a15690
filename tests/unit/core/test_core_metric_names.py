"""Metric naming: relayrl_<service>_<quantity>_<unit> in base units."""

from __future__ import annotations

import pytest

from relayrl.core.metrics import check_service_name, metric_name


def test_metric_name_follows_the_pattern() -> None:
    assert metric_name("reward", "grpc_requests", "total") == "relayrl_reward_grpc_requests_total"
    assert (
        metric_name("weightsync", "bucket_size", "bytes") == "relayrl_weightsync_bucket_size_bytes"
    )


@pytest.mark.parametrize("service", ["rollout-gateway", "Reward", "reward service", "", "1st"])
def test_service_names_must_be_snake_case(service: str) -> None:
    with pytest.raises(ValueError, match="lower snake_case"):
        check_service_name(service)


def test_bad_service_name_error_suggests_a_fix() -> None:
    with pytest.raises(ValueError, match="try 'rollout_gateway'"):
        metric_name("rollout-gateway", "requests", "total")


@pytest.mark.parametrize(
    ("unit", "base"), [("ms", "seconds"), ("mib", "bytes"), ("percent", "ratio")]
)
def test_non_base_units_are_refused(unit: str, base: str) -> None:
    with pytest.raises(ValueError, match=f"record {base} instead"):
        metric_name("reward", "latency", unit)


def test_quantity_must_not_repeat_the_unit() -> None:
    with pytest.raises(ValueError, match="already ends with the unit"):
        metric_name("reward", "latency_seconds", "seconds")


@pytest.mark.parametrize(("quantity", "unit"), [("Latency", "seconds"), ("latency", "Sec-onds")])
def test_parts_must_be_snake_case(quantity: str, unit: str) -> None:
    with pytest.raises(ValueError, match="lower snake_case"):
        metric_name("reward", quantity, unit)
