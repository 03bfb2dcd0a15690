"""The engine HTTP client is bounded as `engines.http` says, and an engine that went silent
fails its calls within those bounds (docs/recovery.md#silent-peers)."""

from __future__ import annotations

import asyncio
import time

import pytest

from relayrl.core.config import TcpKeepaliveConfig
from relayrl.inference.client import EngineUnavailable, VllmEngineClient
from relayrl.inference.config import EngineHttpConfig
from relayrl_testkit.helpers.silent_peer import (
    SilentListener,
    held_http_server,
    keepalive_options_of,
)

SHORT = EngineHttpConfig(
    connect_timeout_s=0.3,
    control_timeout_s=0.3,
    health_timeout_s=0.3,
    tcp_keepalive=TcpKeepaliveConfig(idle_s=7, interval_s=3, probes=2),
)
SLACK_S = 1.0


def test_every_call_bounds_the_connect_and_defaults_to_the_control_deadline() -> None:
    client = VllmEngineClient("http://engine:8000", http=SHORT, request_timeout_s=600)
    control = client.call_timeout()
    assert (control.total, control.sock_connect) == (0.3, 0.3)
    assert client.call_timeout(600).sock_connect == 0.3


def test_the_clients_connections_carry_tcp_keepalive() -> None:
    async def scenario() -> dict[str, int]:
        async with held_http_server() as url:
            client = VllmEngineClient(url, http=SHORT)
            try:
                async with client._http().get(url + "/health") as response:
                    return keepalive_options_of(
                        response.connection.transport.get_extra_info("socket")
                    )
            finally:
                await client.close()

    assert asyncio.run(scenario()) == {
        "SO_KEEPALIVE": 1,
        "TCP_KEEPIDLE": 7,
        "TCP_KEEPINTVL": 3,
        "TCP_KEEPCNT": 2,
        "TCP_USER_TIMEOUT": 13_000,
    }


def test_a_silent_engine_fails_control_calls_and_health_checks_within_their_deadlines() -> None:
    async def scenario(url: str) -> None:
        client = VllmEngineClient(url, http=SHORT)
        try:
            start = time.monotonic()
            with pytest.raises(EngineUnavailable):
                await client.pause("keep")
            assert time.monotonic() - start < SHORT.control_timeout_s + SLACK_S
            start = time.monotonic()
            assert await client.health() is False
            assert time.monotonic() - start < SHORT.health_timeout_s + SLACK_S
        finally:
            await client.close()

    with SilentListener() as engine:
        asyncio.run(scenario(f"http://{engine.address}"))
