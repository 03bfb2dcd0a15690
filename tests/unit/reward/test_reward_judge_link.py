"""A judge's HTTP client bounds the connect and carries TCP keepalive, so a judge whose
network went fails its request as infrastructure even with no timeout_s
(docs/recovery.md#silent-peers)."""

from __future__ import annotations

import asyncio

from relayrl.core.config import HttpLinkConfig, TcpKeepaliveConfig
from relayrl.reward.managers.judge import JudgeClient, RemoteConfig
from relayrl_testkit.helpers.silent_peer import held_http_server, keepalive_options_of

LINK = HttpLinkConfig(
    connect_timeout_s=0.5, tcp_keepalive=TcpKeepaliveConfig(idle_s=6, interval_s=2, probes=4)
)


def test_the_judge_client_bounds_its_connections() -> None:
    async def scenario() -> tuple[float | None, dict[str, int]]:
        async with held_http_server() as url:
            client = JudgeClient(RemoteConfig(base_url=url, model="judge", http=LINK), "/v1")
            try:
                session = client._open()
                async with session.post(client.url, data=b"{}") as response:
                    sock = response.connection.transport.get_extra_info("socket")
                    return session.timeout.sock_connect, keepalive_options_of(sock)
            finally:
                await client.close()

    sock_connect, options = asyncio.run(scenario())
    assert sock_connect == 0.5
    assert options == {
        "SO_KEEPALIVE": 1,
        "TCP_KEEPIDLE": 6,
        "TCP_KEEPINTVL": 2,
        "TCP_KEEPCNT": 4,
        "TCP_USER_TIMEOUT": 14_000,
    }
