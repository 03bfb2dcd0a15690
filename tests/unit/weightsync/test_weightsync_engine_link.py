"""weight-sync's clients of the engines take `engines.http` for the connection and control
calls, and the caller's deadline for worker RPCs such as a load."""

from __future__ import annotations

from relayrl.inference.config import EngineHttpConfig
from relayrl.weightsync.server import engine_clients


def test_engine_clients_are_bounded_by_the_engines_http_section() -> None:
    http = EngineHttpConfig(connect_timeout_s=2, control_timeout_s=9)
    client = engine_clients(http, token=None)("http://engine-0:8000", 300.0)
    assert client.bounds is http
    assert client.call_timeout().total == 9 and client.call_timeout().sock_connect == 2
    assert client._rpc_timeout_s == 300.0
