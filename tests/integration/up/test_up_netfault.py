"""The fault harness alone (relayrl_testkit.netfault on relayrl.up.hosts), without `relayrl up`:
two hosts of our own, named after this test's PID, a TCP echo server on one and sockets on the
other. A partition stalls old and new connections alike, a refusal fails them at once, a
half-open fault stalls only the connections that were open when it began, the real half-open
case leaves the client talking to a server that forgot it, a slow link is slow, one direction
takes only that direction, every fault heals by its deadline, and removing the network leaves
nothing named after the test."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from relayrl.up.hosts import HostNetwork, remove_tagged, tag_of, tagged
from relayrl_testkit.netfault import HOSTS_MISSING, Faults

pytestmark = pytest.mark.skipif(
    HOSTS_MISSING is not None,
    reason=f"hosts of our own: relayrl up's hosts.isolate {HOSTS_MISSING}",
)

ECHO = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
while True:
    conn, _ = server.accept()
    threading.Thread(target=echo, args=(conn,), daemon=True).start()
"""
PORT = 7000
STALLED_S = 1.0
"""How long a stalled socket is waited for: far beyond a round trip on a bridge."""


@dataclass
class Pair:
    """A client host and a server host with an echo server on it."""

    network: HostNetwork
    faults: Faults
    server: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return self.network.hosts["server"].address

    def start_server(self) -> None:
        with self.network.entered("server"):  # born in the server's namespace
            self.server = subprocess.Popen(
                [sys.executable, "-c", ECHO, self.address, str(PORT)], stdout=subprocess.PIPE
            )
        assert self.server.stdout is not None and self.server.stdout.readline() == b"ready\n"

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.send_signal(signal.SIGKILL)
            self.server.wait(10)
            self.server = None

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        with self.network.entered("client"):
            conn = socket.create_connection((self.address, PORT), timeout=timeout_s)
        conn.settimeout(timeout_s)
        return conn


def echoes(conn: socket.socket, payload: bytes = b"ping", timeout_s: float = 5.0) -> bool:
    """Whether `payload` comes back within `timeout_s`."""
    conn.sendall(payload)
    return received(conn, len(payload), timeout_s) == payload


def received(conn: socket.socket, n: int, timeout_s: float) -> bytes:
    """Up to `n` bytes that arrive within `timeout_s` (fewer at the end of the stream)."""
    conn.settimeout(timeout_s)
    got = b""
    with contextlib.suppress(TimeoutError):
        while len(got) < n:
            chunk = conn.recv(n - len(got))
            if not chunk:
                break
            got += chunk
    return got


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    network = HostNetwork.plan(["client", "server"])  # named after this process
    assert network.tag == tag_of(os.getpid())
    pair = Pair(network, Faults(network))
    try:
        network.create()
        pair.start_server()
        yield pair
    finally:  # whatever happened
        pair.faults.heal_all()
        pair.stop_server()
        network.remove()
        remove_tagged(network.tag)


def netns_of(path: str) -> int:
    return os.stat(path).st_ino


def test_a_child_spawned_on_a_host_is_born_there_and_only_the_spawning_thread_moves(
    pair: Pair,
) -> None:
    assert pair.server is not None
    own = netns_of("/proc/thread-self/ns/net")
    server = netns_of(str(pair.network.hosts["server"].netns_path))
    assert netns_of(f"/proc/{pair.server.pid}/ns/net") == server != own
    asked, seen = threading.Event(), {}

    def bystander() -> None:  # a thread that was running all along
        asked.wait(10)
        seen["bystander"] = netns_of("/proc/thread-self/ns/net")

    thread = threading.Thread(target=bystander)
    thread.start()
    with pair.network.entered("client"):
        seen["spawner"] = netns_of("/proc/thread-self/ns/net")
        asked.set()
        thread.join(10)
    assert seen == {"spawner": netns_of(str(pair.network.hosts["client"].netns_path)),
                    "bystander": own}  # fmt: skip
    assert netns_of("/proc/thread-self/ns/net") == own


def test_a_partition_stalls_old_and_new_connections_until_it_heals(pair: Pair) -> None:
    old = pair.connect()
    assert echoes(old)
    with pair.faults.during("partition", "client", "server", for_s=60) as fault:
        with pytest.raises(TimeoutError):
            pair.connect(timeout_s=STALLED_S)
        assert not echoes(old, b"during", timeout_s=STALLED_S)
    assert fault.healed is not None and fault.started < fault.healed
    # the data sent during the partition is retransmitted; new connections work
    assert received(old, 6, timeout_s=10) == b"during"
    assert echoes(pair.connect())


def test_a_refusal_fails_new_and_established_connections_at_once(pair: Pair) -> None:
    old = pair.connect()
    assert echoes(old)
    with pair.faults.during("refuse", "client", "server", for_s=60):
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            pair.connect()
        assert time.monotonic() - started < STALLED_S
        with pytest.raises(ConnectionResetError):
            echoes(old)
    assert echoes(pair.connect())


def test_a_half_open_fault_stalls_only_the_connections_open_when_it_began(pair: Pair) -> None:
    old = pair.connect()
    assert echoes(old)
    with pair.faults.during("half_open", "client", "server", for_s=60):
        assert not echoes(old, b"during", timeout_s=STALLED_S)
        new = pair.connect()
        assert echoes(new, b"fresh")
    assert received(old, 6, timeout_s=10) == b"during"
    assert echoes(new)


def test_the_real_half_open_case_the_server_restarts_behind_a_partition(pair: Pair) -> None:
    old = pair.connect()
    assert echoes(old)

    def restart() -> None:  # the server forgets every connection it had
        pair.stop_server()
        pair.start_server()

    with pair.faults.during("half_open_restart", "client", "server", for_s=60, restart=restart):
        assert not echoes(old, b"lost", timeout_s=STALLED_S)  # nothing says it is gone
    # once healed, what the client sent reaches a host with no such connection: a reset (or
    # first the goodbye the dead server's kernel kept sending); the new server answers anew
    try:
        ended = received(old, 4, timeout_s=10)
    except ConnectionResetError:
        ended = b""
    assert ended == b""
    assert echoes(pair.connect())


def test_a_slow_link_carries_about_its_rate(pair: Pair) -> None:
    conn = pair.connect()
    payload = os.urandom(300_000)

    def echo_all() -> float:
        started = time.monotonic()
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            got += conn.recv(65536)
        sender.join()
        assert bytes(got) == payload
        return time.monotonic() - started

    conn.settimeout(30)
    fast = echo_all()
    rate = 200_000
    with pair.faults.during("slow", "client", "server", for_s=60, rate_bytes_s=rate,
                            direction="a_to_b"):  # fmt: skip
        slow = echo_all()
    assert slow > max(10 * fast, 0.3 * len(payload) / rate), (fast, slow)


def test_one_direction_takes_only_the_packets_that_go_that_way(pair: Pair) -> None:
    sockets = {}
    for side in ("client", "server"):
        with pair.network.entered(side):
            sockets[side] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sockets[side].bind((pair.network.hosts[side].address, PORT + 1))
        sockets[side].settimeout(STALLED_S)

    def arrives(sender: str, receiver: str) -> bool:
        address = pair.network.hosts[receiver].address
        sockets[sender].sendto(sender.encode(), (address, PORT + 1))
        try:
            return sockets[receiver].recv(100) == sender.encode()
        except TimeoutError:
            return False

    try:
        with pair.faults.during("partition", "client", "server", for_s=60, direction="a_to_b"):
            assert not arrives("client", "server")
            assert arrives("server", "client")
        # the root namespace (relayrl up itself) as one side: the rules go in the other's
        with pair.faults.during("partition", "server", "up", for_s=60, direction="b_to_a"):
            with pytest.raises(TimeoutError):  # up -> server
                socket.create_connection((pair.address, PORT), timeout=STALLED_S)
            assert arrives("client", "server") and arrives("server", "client")  # untouched
        assert arrives("client", "server") and arrives("server", "client")
    finally:
        for sock in sockets.values():
            sock.close()


def test_a_fault_heals_by_its_deadline_even_if_nobody_heals_it(pair: Pair) -> None:
    fault = pair.faults.inject("partition", "client", "server", for_s=0.5)
    with pytest.raises(TimeoutError):
        pair.connect(timeout_s=0.3)
    time.sleep(0.5)
    assert fault.healed is not None and 0.5 <= fault.lasted_s < 2.0, fault
    assert echoes(pair.connect())


def test_removing_the_network_leaves_nothing_named_after_the_test() -> None:
    network = HostNetwork.plan(["one", "two"], tag=f"{tag_of(os.getpid())}x")  # beside pair's
    try:
        network.create()
        assert len(tagged(network.tag)) == 5  # two namespaces, two veths, the bridge
        with network.entered("one"):  # a connection still open when it goes
            server = socket.create_server((network.hosts["one"].address, PORT))
        with network.entered("two"):
            client = socket.create_connection((network.hosts["one"].address, PORT), timeout=5)
        network.remove()
        assert tagged(network.tag) == []
        client.close()
        server.close()
    finally:
        remove_tagged(network.tag)
