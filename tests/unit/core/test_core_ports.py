"""`relayrl.core.ports.free_port`: ports chosen for a later bind come from below the kernel's
ephemeral range, are free, and are distinct when asked for together."""

from __future__ import annotations

import socket

import pytest

from relayrl.core import ports


def test_a_chosen_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    for _ in range(50):
        port = ports.free_port()
        assert ports.LOWEST <= port < ports.ephemeral_low()
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_ports_chosen_with_one_set_are_distinct_and_recorded_in_it() -> None:
    taken: set[int] = set()
    chosen = [ports.free_port(avoid=taken) for _ in range(200)]
    assert len(set(chosen)) == 200
    assert taken == set(chosen)


def test_a_port_in_use_or_avoided_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        with socket.socket() as one, socket.socket() as two:  # two other ports, free again after
            one.bind(("127.0.0.1", 0))
            two.bind(("127.0.0.1", 0))
            avoided, free = one.getsockname()[1], two.getsockname()[1]
        candidates = iter([busy.getsockname()[1], avoided, free])
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(candidates))
        assert ports.free_port(avoid={avoided}) == free


def test_no_room_below_the_ephemeral_range_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOWEST)
    with pytest.raises(RuntimeError, match="below the ephemeral range"):
        ports.free_port()
