"""TCP keepalive on the sockets of clients that have no pings of their own
(`TcpKeepaliveConfig`, docs/recovery.md#silent-peers)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from relayrl.core.config import TcpKeepaliveConfig

AddrInfo = tuple[Any, ...]
"""One entry of socket.getaddrinfo: (family, type, proto, canonname, sockaddr)."""


def keepalive_socket_options(config: TcpKeepaliveConfig) -> list[tuple[int, int, int]]:
    """(level, option, value) for every socket option of `config`: keepalive probes while
    nothing flows, and the same bound (TCP_USER_TIMEOUT) on data sent and never
    acknowledged, which keepalive alone leaves to the retransmission timeout (about 15
    minutes on Linux). The per-option knobs are Linux's; elsewhere only SO_KEEPALIVE."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", config.idle_s),
        ("TCP_KEEPINTVL", config.interval_s),
        ("TCP_KEEPCNT", config.probes),
        ("TCP_USER_TIMEOUT", config.silent_peer_s * 1000),
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


def apply_tcp_keepalive(sock: socket.socket, config: TcpKeepaliveConfig) -> None:
    """Makes the kernel close `sock` once its peer has been silent for
    `config.silent_peer_s`."""
    for level, option, value in keepalive_socket_options(config):
        sock.setsockopt(level, option, value)


def keepalive_socket_factory(config: TcpKeepaliveConfig) -> Callable[[AddrInfo], socket.socket]:
    """A `socket_factory` for aiohttp's TCPConnector: each connection's socket with
    `apply_tcp_keepalive`."""

    def make(addr_info: AddrInfo) -> socket.socket:
        family, kind, proto = addr_info[:3]
        sock = socket.socket(family, kind, proto)
        try:
            apply_tcp_keepalive(sock, config)
        except OSError:
            sock.close()
            raise
        return sock

    return make
