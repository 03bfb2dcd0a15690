"""The /metrics endpoint over real HTTP on a free loopback port."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from relayrl.core.config import MetricsConfig
from relayrl.core.metrics import MetricsServer, metric_name


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_serves_only_its_own_registry() -> None:
    mine, other = CollectorRegistry(), CollectorRegistry()
    Counter(metric_name("coretest", "items", "total"), "Items.", registry=mine).inc(3)
    Counter(metric_name("othertest", "items", "total"), "Items.", registry=other).inc()
    server = MetricsServer.from_config(MetricsConfig(port=0), mine)
    port = server.start()
    try:
        body = get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.stop()
    assert "relayrl_coretest_items_total 3.0" in body.splitlines()
    assert "relayrl_othertest" not in body


def test_stop_releases_the_port() -> None:
    server = MetricsServer(CollectorRegistry())
    port = server.start()
    server.stop()
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{port}/metrics")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free again


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = MetricsServer(CollectorRegistry(), port=taken.getsockname()[1])
        with pytest.raises(OSError, match=r"choose another metrics\.port"):
            server.start()


def test_port_is_only_known_while_started() -> None:
    with pytest.raises(RuntimeError, match="not started"):
        _ = MetricsServer(CollectorRegistry()).port
