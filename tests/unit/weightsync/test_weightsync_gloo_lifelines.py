"""The lifelines of the torch_distributed transport: a peer's closed connection, read as done,
aborted (with its reason) or died (without a word)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from relayrl.dataplane.transports.base import PEER_KEEPALIVE
from relayrl.dataplane.transports.torch_distributed import (
    _FAREWELL_ABORT,
    _FAREWELL_DONE,
    _Failure,
    _Lifelines,
    _StoreEndpoint,
)
from relayrl_testkit.helpers.silent_peer import keepalive_options_of


@pytest.fixture
def peer_and_lifelines() -> Iterator[tuple[socket.socket, _Lifelines]]:
    """A loopback TCP connection: the peer's end, and ours as the lifeline to "receiver 1"."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname(), timeout=5)
        ours, _ = listener.accept()
    lifelines = _Lifelines()
    lifelines.add("receiver 1", ours)
    yield peer, lifelines
    peer.close()
    lifelines.close(b"")


def endpoint_with(lifelines: _Lifelines) -> _StoreEndpoint:
    """Sender 0 as far as its lifelines go (no store)."""
    endpoint = _StoreEndpoint()
    endpoint.name = "sender 0"
    endpoint._store, endpoint._store_reachable = None, False
    endpoint._lifelines = lifelines
    return endpoint


def failure_once_closed(endpoint: _StoreEndpoint) -> _Failure | None:
    """What the endpoint makes of its lifeline once that has closed (a word and the close may
    arrive apart)."""
    deadline = time.monotonic() + 5
    while len(endpoint._lifelines) and time.monotonic() < deadline:
        if failure := endpoint._peer_failure(wait_s=0.1):
            return failure
    assert not len(endpoint._lifelines), "the lifeline did not close"
    return None


def test_a_lifeline_is_probed_so_that_a_vanished_host_is_lost_within_11_s() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname(), timeout=5)
        ours, _ = listener.accept()
    lifelines = _Lifelines()
    lifelines.add("receiver 1", ours)
    assert PEER_KEEPALIVE.silent_peer_s == 11
    assert keepalive_options_of(ours) == {
        "SO_KEEPALIVE": 1,
        "TCP_KEEPIDLE": PEER_KEEPALIVE.idle_s,
        "TCP_KEEPINTVL": PEER_KEEPALIVE.interval_s,
        "TCP_KEEPCNT": PEER_KEEPALIVE.probes,
        "TCP_USER_TIMEOUT": PEER_KEEPALIVE.silent_peer_s * 1000,
    }
    peer.close()
    lifelines.close(b"")


def test_an_open_lifeline_is_no_loss(peer_and_lifelines: tuple[socket.socket, _Lifelines]) -> None:
    _, lifelines = peer_and_lifelines
    assert lifelines.losses(wait_s=0.05) == []
    assert endpoint_with(lifelines)._peer_failure() is None


def test_a_peer_that_dies_is_lost_without_a_word(
    peer_and_lifelines: tuple[socket.socket, _Lifelines],
) -> None:
    peer, lifelines = peer_and_lifelines
    peer.close()
    failure = failure_once_closed(endpoint_with(lifelines))
    assert failure is not None
    assert failure.peer == "receiver 1"
    assert failure.root_cause is None  # this side's own error is the root cause
    assert "lost receiver 1" in failure.reason and "without a word" in failure.reason
    assert lifelines.losses() == []  # reported once


def test_a_peer_that_aborts_passes_its_reason_on(
    peer_and_lifelines: tuple[socket.socket, _Lifelines],
) -> None:
    peer, lifelines = peer_and_lifelines
    peer.sendall(_FAREWELL_ABORT + b"loading bucket 3 failed")
    peer.close()
    failure = failure_once_closed(endpoint_with(lifelines))
    assert failure is not None
    assert failure.peer == "receiver 1"
    assert failure.root_cause == "loading bucket 3 failed"
    assert failure.reason == "receiver 1 aborted: loading bucket 3 failed"


def test_a_peer_that_is_done_may_go(
    peer_and_lifelines: tuple[socket.socket, _Lifelines],
) -> None:
    peer, lifelines = peer_and_lifelines
    peer.sendall(_FAREWELL_DONE)
    peer.close()
    assert failure_once_closed(endpoint_with(lifelines)) is None


def test_closing_says_the_last_word(
    peer_and_lifelines: tuple[socket.socket, _Lifelines],
) -> None:
    peer, lifelines = peer_and_lifelines
    peer.sendall(b"unread")  # must not turn our close into a reset that drops the word
    lifelines.close(_FAREWELL_ABORT + b"why")
    received = b""
    while chunk := peer.recv(1024):
        received += chunk
    assert received == _FAREWELL_ABORT + b"why"
