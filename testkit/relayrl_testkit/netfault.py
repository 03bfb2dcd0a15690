"""Network faults between hosts of our own (relayrl.up.hosts), for a bounded time, in both
directions or one (docs/recovery.md#hosts-of-our-own).

    faults = Faults(network_of_run(run_dir), log_path=run_dir / "faults.jsonl")
    with faults.during("partition", "gateway", "redis", for_s=60):
        ...                                     # healed when the block ends, or after 60 s
    faults.hold("refuse", "trainer", "weightsync", for_s=5)   # blocks, then heals

Kinds (packets between hosts `a` and `b`; `direction` picks which):
- partition: every packet dropped. A connect times out; an established flow stalls.
- refuse: every TCP packet answered with a reset (other protocols: ICMP port unreachable).
  A connect fails at once with ECONNREFUSED; an established connection with ECONNRESET.
- half_open: the TCP flows that were established when the fault began lose every packet,
  while a new connection still works: the peer looks alive and never answers on the old
  connection. Flows are told apart by a conntrack mark that only the first packet (the SYN)
  of a connection opened during the fault sets.
- half_open_restart: the real half-open case. `b` is cut off from `a`, `restart()` (the
  test's) restarts the peer behind the partition, so that it forgets the connection, then the
  partition lasts until the end; `a` learns of it only when it sends again after the heal
  (a reset), or by its own timeouts.
- slow: the link carries at most `rate_bytes_s` in each chosen direction; the excess is
  dropped (a policer: netem, which would delay instead, is not available everywhere), so TCP
  backs off to about that rate.

Each fault is one nftables table in the namespace of each receiving host, on its input
(packets are lost on arrival, as on a real network: the sender notices nothing); the root
namespace is never touched (packets to `up` are taken on their sender's output). Each table
is added atomically with `nft -f -` and deleted on heal. Every fault records when it started
and healed (wall clock), and the JSON lines file, when given, gets one record per heal.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from relayrl.up.hosts import HostNetwork, missing_for_hosts
from relayrl.up.stack_state import StackState

Kind = Literal["partition", "refuse", "half_open", "half_open_restart", "slow"]
Direction = Literal["both", "a_to_b", "b_to_a"]
"""Which packets the fault takes: both ways, only those `a` sends to `b`, or the reverse."""
KINDS: tuple[str, ...] = Kind.__args__  # type: ignore[attr-defined]
ROOT = "up"
"""The root namespace's host: `relayrl up` itself (evaluations, metrics, status), on the
bridge's address."""
HOSTS_MISSING = missing_for_hosts()
"""Why hosts of our own cannot be made here (None: they can): a test's skip reason."""


@dataclass(frozen=True)
class End:
    """One end of a link: a part's host, or the root namespace (`up`, no namespace)."""

    name: str
    address: str
    netns: str | None


def end_of(network: HostNetwork, name: str) -> End:
    if name == ROOT:
        return End(ROOT, network.bridge_address, None)
    host = network.host(name)
    if host is None:
        raise KeyError(f"no host {name!r}; hosts: {', '.join([ROOT, *network.hosts])}")
    return End(name, host.address, host.netns)


def network_of_run(run_dir: Path) -> HostNetwork:
    """The hosts of a run of `relayrl up` with `hosts.isolate`, as its stack.json has them."""
    hosts = StackState.read(run_dir).hosts
    if hosts is None:
        raise ValueError(f"{run_dir} was not run with hosts.isolate")
    return HostNetwork.from_state(hosts)


@dataclass
class Fault:
    """One fault as it happened: what, between whom, when it started and healed."""

    kind: str
    a: str
    b: str
    direction: str
    limit_s: float
    """It is healed after this long at the latest."""
    started: float = 0.0
    healed: float | None = None
    rate_bytes_s: int | None = None
    netns: list[str] = field(default_factory=list)
    """The namespaces that hold its table."""
    table: str = ""
    _heal: Callable[[], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def heal(self) -> None:
        """Removes the fault now; idempotent (the timer and the caller may both heal)."""
        with self._lock:
            if self.healed is not None:
                return
            if self._heal is not None:
                self._heal()
            self.healed = time.time()

    @property
    def lasted_s(self) -> float | None:
        return None if self.healed is None else self.healed - self.started

    def record(self) -> dict[str, Any]:
        """Its public fields (asdict would deep-copy the lock and the heal callback too)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


_marks = itertools.count(1)


class Faults:
    """Injects faults between the hosts of `network` (and `up`, the root namespace); every
    fault is healed by its deadline (`for_s`), by its context's end, or by `heal_all()`."""

    def __init__(self, network: HostNetwork, log_path: Path | None = None) -> None:
        self.network = network
        self.log_path = log_path
        self.faults: list[Fault] = []

    def inject(
        self,
        kind: Kind,
        a: str,
        b: str,
        *,
        for_s: float,
        direction: Direction = "both",
        rate_bytes_s: int | None = None,
        restart: Callable[[], None] | None = None,
    ) -> Fault:
        """Starts a fault between `a` and `b` and returns it; a timer heals it after `for_s`
        unless it is healed before. `rate_bytes_s` goes with `slow`; `restart` (called once
        the partition is in place, in this thread) with `half_open_restart`."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(KINDS)}")
        if (kind == "slow") != (rate_bytes_s is not None):
            raise ValueError("rate_bytes_s goes with slow, and slow needs it")
        if (kind == "half_open_restart") != (restart is not None):
            raise ValueError("restart goes with half_open_restart, and it needs one")
        if not 0 < for_s <= 86_400:
            raise ValueError(f"for_s {for_s}: a fault lasts a bounded time, up to a day")
        host_a, host_b = end_of(self.network, a), end_of(self.network, b)
        if a == b or (host_a.netns is None and host_b.netns is None):
            raise ValueError(f"a fault needs two hosts, one of them not {ROOT}: {a}, {b}")
        mark = (os.getpid() % 0x10000) << 16 | next(_marks) % 0x10000
        table = f"netfault_{mark:08x}"
        fault = Fault(kind, a, b, direction, for_s, rate_bytes_s=rate_bytes_s, table=table)
        flows = [(host_a, host_b)] if direction != "b_to_a" else []
        flows += [(host_b, host_a)] if direction != "a_to_b" else []
        for netns, (there, chains) in placement(flows).items():
            nft(netns, "-f", "-", input=ruleset(table, kind, there, chains, mark, rate_bytes_s))
            fault.netns.append(netns)
        fault.started = time.time()
        fault._heal = lambda: self._remove(fault)
        self.faults.append(fault)
        timer = threading.Timer(for_s, fault.heal)
        timer.daemon = True
        timer.start()
        if restart is not None:
            try:
                restart()
            except BaseException:
                fault.heal()
                raise
        return fault

    @contextlib.contextmanager
    def during(
        self, kind: Kind, a: str, b: str, *, for_s: float, **options: Any
    ) -> Iterator[Fault]:
        """The fault while the block runs, healed when it ends (or after `for_s`, if that
        comes first)."""
        fault = self.inject(kind, a, b, for_s=for_s, **options)
        try:
            yield fault
        finally:
            fault.heal()

    def hold(self, kind: Kind, a: str, b: str, *, for_s: float, **options: Any) -> Fault:
        """The fault for `for_s`, then healed; returns it once healed."""
        fault = self.inject(kind, a, b, for_s=for_s, **options)
        time.sleep(max(0.0, fault.started + for_s - time.time()))
        fault.heal()
        return fault

    def heal_all(self) -> None:
        for fault in self.faults:
            fault.heal()

    def _remove(self, fault: Fault) -> None:
        # A namespace may be gone already (the run stopped): then so is its part.
        for netns in fault.netns:
            nft(netns, "delete", "table", "inet", fault.table, check=False)
        if self.log_path is not None:
            record = fault.record() | {"healed": time.time()}
            with self.log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")


def placement(flows: list[tuple[End, End]]) -> dict[str, tuple[str, dict[str, bool]]]:
    """Where the rules for packets `sender -> receiver` of each of `flows` go: the receiver's
    input chain, so that the sender sees nothing a real network would not show it (a drop in
    its own output chain fails its send at once); the sender's output chain only when the
    receiver is the root namespace, which no fault touches. netns -> (its peer's address,
    which of its chains take packets)."""
    placed: dict[str, tuple[str, dict[str, bool]]] = {}
    for sender, receiver in flows:
        here, there, chain = receiver, sender, "input"
        if receiver.netns is None:
            here, there, chain = sender, receiver, "output"
        assert here.netns is not None
        chains = placed.setdefault(here.netns, (there.address, {"input": False, "output": False}))
        chains[1][chain] = True
    return placed


def ruleset(
    table: str,
    kind: str,
    there: str,
    chains: Mapping[str, bool],
    mark: int,
    rate_bytes_s: int | None = None,
) -> str:
    """The nftables table of one fault, in the namespace of the near host; `there` is the far
    host's address, `chains` which of input (packets from there) and output (packets to
    there) it takes."""
    peer = {"input": f"ip saddr {there}", "output": f"ip daddr {there}"}
    body = []
    for chain in ("input", "output"):
        taken = chains[chain]
        match = peer[chain]
        rules: list[str] = []
        if kind in ("partition", "half_open_restart") and taken:
            rules.append(f"{match} drop")
        elif kind == "refuse" and taken:
            # the refusals themselves pass: a reset or an ICMP error made by the other
            # chain's reject has the far host as one of its addresses
            rules.append(f"{match} tcp flags rst accept")
            rules.append(f"{match} icmp type destination-unreachable accept")
            rules.append(f"{match} meta l4proto tcp reject with tcp reset")
            rules.append(f"{match} reject")
        elif kind == "half_open":
            # a connection opened during the fault is marked by its SYN, on whichever side
            # it is seen first; every other TCP packet to or from there is an old flow's
            rules.append(f"{match} tcp flags & (syn | ack) == syn ct state new ct mark set {mark}")
            if taken:
                rules.append(f"{match} meta l4proto tcp ct state invalid drop")
                rules.append(f"{match} meta l4proto tcp ct mark != {mark} drop")
        elif kind == "slow" and taken:
            rules.append(f"{match} limit rate over {rate_bytes_s} bytes/second drop")
        if rules:
            body.append(
                f"  chain {chain} {{\n"
                f"    type filter hook {chain} priority -10; policy accept;\n"
                + "".join(f"    {rule}\n" for rule in rules)
                + "  }\n"
            )
    return f"table inet {table} {{\n{''.join(body)}}}\n"


def nft(netns: str, *args: str, input: str | None = None, check: bool = True) -> None:
    """`nft *args` inside the named network namespace."""
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", *args],
        input=input, capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise RuntimeError(f"nft {' '.join(args)} in {netns} failed: {result.stderr.strip()}")
