"""EndpointSlice discovery talks to the API server with the connect bound and TCP keepalive
of `engines.kubernetes.http`, not the client's own 165 s keepalive
(docs/recovery.md#silent-peers)."""

from __future__ import annotations

import socket

from relayrl.core.config import HttpLinkConfig, TcpKeepaliveConfig
from relayrl.gateway.config import KubernetesDiscoveryConfig
from relayrl.gateway.discovery import EndpointSliceDiscovery

LINK = HttpLinkConfig(
    connect_timeout_s=2.0, tcp_keepalive=TcpKeepaliveConfig(idle_s=4, interval_s=2, probes=3)
)


def test_the_api_client_keeps_tcp_keepalive_and_bounds_the_connect() -> None:
    config = KubernetesDiscoveryConfig(service="engine", api_host="http://127.0.0.1:1", http=LINK)
    discovery = EndpointSliceDiscovery(pool=None, config=config)  # type: ignore[arg-type]
    options = discovery._build_api().api_client.configuration.socket_options
    assert (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1) in options
    assert (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1) in options  # urllib3's own, kept
    assert (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 4) in options
    assert (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 10_000) in options
    connect_s, read_s = discovery._timeout()
    assert connect_s == 2.0 and read_s > config.watch_timeout_s
