"""Choosing a free TCP port for a server that binds it later.

A port the kernel hands out for `bind(0)` comes from its ephemeral range, the same range it
draws the source ports of outgoing connections from. Between choosing a port and the server
binding it (a vLLM boot, a warm start, a pod started minutes later) any outgoing connection on
the machine may take it as its source port, and the server then fails with "Address already
in use" (seen with `relayrl up`'s trainer under a busy test run). So `free_port` chooses at
random below that range, where the kernel never assigns source ports, among the ports free at
the time of the call.
"""

from __future__ import annotations

import random
import socket
from collections.abc import MutableSet
from pathlib import Path

LOWEST = 10_000
"""The lowest port chosen: above the well-known and most registered service ports."""

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_ATTEMPTS = 1_000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", *, avoid: MutableSet[int] | None = None) -> int:
    """A port that nothing on `host` listens on now, below the ephemeral range, and not in
    `avoid` (to which it is added: pass one set to get several distinct ports)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = ephemeral_low() - 1
    if high <= LOWEST:
        raise RuntimeError(f"no ports below the ephemeral range {_EPHEMERAL_RANGE} starts at")
    for _ in range(_ATTEMPTS):
        port = random.randint(LOWEST, high)
        if avoid is not None and port in avoid:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        if avoid is not None:
            avoid.add(port)
        return port
    raise RuntimeError(f"no free port on {host} between {LOWEST} and {high}")
