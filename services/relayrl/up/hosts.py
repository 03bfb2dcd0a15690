"""Hosts of our own: each part of a local run in a network namespace of its own, joined by
veth pairs to a bridge, so that the links between them are real network links that a test can
cut, refuse, half-open or slow down (docs/recovery.md#hosts-of-our-own). `relayrl up` does this
when `hosts.isolate` asks for it (a test-kit and research option: it needs root, iproute2
and nftables); every other run keeps every part on loopback.

    bridge <tag>-br  10.A.B.1/24, in the root namespace: `relayrl up` itself (evaluations,
                     metrics, status) reaches every part through it
    <tag>-<part>     one namespace per part (redis, reward, gateway, weightsync, trainer,
                     engine-0, agents): `lo` up, `eth0` at 10.A.B.<n>/24, default route via
                     the bridge; the root end of its veth is <tag>-v<n>

`<tag>` is `rl<pid>` of the process that made them, so two runs (two test workers) never
collide, and whatever a run left behind is found by its name (`remove_tagged`). 10.A.B.0/24
is derived from the tag and moved on while it overlaps a route of this machine (another
run's bridge among them).

A child is put in its namespace by its spawning thread: a network namespace is an attribute
of a thread, inherited by the processes it forks, so `entered(part)` switches only the
calling thread in (`setns`) and back out afterwards, as `placement` pins that thread's CPUs.
The child's PID is the one the supervisor tracks (no wrapper process), and a restart from
the supervisor's thread lands in the same namespace. Agent programs are the gateway's
children: the gateway starts them through `nsenter --net`, which execs them in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import subprocess
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.up.stack_state import HostsState, PartHost

NETNS_DIR = Path("/run/netns")
"""Where `ip netns` keeps a named namespace (a bind mount of its nsfs file)."""
CLONE_NEWNET = 0x40000000
IFNAMSIZ = 15
"""Longest interface name Linux takes."""
_SYS_NET = Path("/sys/class/net")
_ROUTES = Path("/proc/net/route")
TOOLS = {"ip": "iproute2", "nft": "nftables", "nsenter": "util-linux"}
"""What hosts of our own need, by the Debian package that has it."""


class HostsError(RuntimeError):
    """The host network could not be made (the `ip` command's message)."""


def missing_for_hosts() -> str | None:
    """Why this process cannot give each part a host of its own, in a phrase; None if it can."""
    if os.geteuid() != 0:
        return "needs root (it makes network namespaces, veth pairs and a bridge)"
    for tool, package in TOOLS.items():
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian {package}; `make setup` installs it)"
    if not _SYS_NET.is_dir():
        return f"needs {_SYS_NET} (Linux)"
    return None


def tag_of(pid: int) -> str:
    """The prefix of every name the host network of process `pid` uses."""
    return f"rl{pid}"


@dataclass(frozen=True)
class Host:
    """One part's host."""

    part: str
    netns: str
    address: str
    veth: str
    """The root namespace's end of its veth pair (the other end is `eth0` inside)."""

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns


@dataclass
class HostNetwork:
    """The namespaces, veth pairs and bridge of one run; made by `create()`, removed by
    `remove()` (idempotent, also after a partial `create()`)."""

    tag: str
    subnet: ipaddress.IPv4Network
    hosts: dict[str, Host]
    created: bool = field(default=False, compare=False)

    @classmethod
    def plan(
        cls,
        parts: Iterable[str],
        tag: str | None = None,
        taken: Iterable[ipaddress.IPv4Network] | None = None,
    ) -> HostNetwork:
        """Names and addresses for `parts`, named after `tag` (`tag_of` this process by
        default), on a /24 that overlaps none of `taken` (this machine's routes by default).
        Makes nothing."""
        tag = tag_of(os.getpid()) if tag is None else tag
        subnet = free_subnet(zlib.crc32(tag.encode()), list(routes() if taken is None else taken))
        addresses = subnet.hosts()
        assert next(addresses) == bridge_address(subnet)  # the bridge's
        hosts: dict[str, Host] = {}
        for n, part in enumerate(parts):
            veth = f"{tag}-v{n}"
            if len(veth) > IFNAMSIZ:
                raise HostsError(f"interface name {veth!r} is longer than {IFNAMSIZ} characters")
            hosts[part] = Host(part, f"{tag}-{part}", str(next(addresses)), veth)
        return cls(tag, subnet, hosts)

    @property
    def bridge(self) -> str:
        return f"{self.tag}-br"

    @property
    def bridge_address(self) -> str:
        return str(bridge_address(self.subnet))

    def addresses(self) -> dict[str, str]:
        """part -> its host's address."""
        return {part: host.address for part, host in self.hosts.items()}

    def host(self, part: str) -> Host | None:
        return self.hosts.get(part)

    # -- making and removing ----------------------------------------------------------------

    def create(self) -> None:
        """The bridge, then each part's namespace and veth pair; on a failure, whatever was
        made is removed and HostsError says which command failed. What a dead process with
        the same PID left under the same names goes first."""
        if self.created:
            return
        self.created = True
        prefix = self.subnet.prefixlen
        try:
            remove_tagged(self.tag)
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts.values():
                ns = ("-n", host.netns)
                _ip("netns", "add", host.netns)
                _ip("link", "add", host.veth, "type", "veth",
                    "peer", "name", "eth0", "netns", host.netns)  # fmt: skip
                _ip(*ns, "link", "set", "lo", "up")
                _ip(*ns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
                _ip(*ns, "link", "set", "eth0", "up")
                _ip(*ns, "route", "add", "default", "via", self.bridge_address)
                _ip("link", "set", host.veth, "master", self.bridge, "up")
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Removes every namespace, veth pair and the bridge of this run; idempotent.

        A namespace outlives its name while a socket in it still holds it (a connection whose
        peer is gone, closing): its veth pair is deleted from this end, so nothing named after
        the run is left even then."""
        if not self.created:
            return
        remove_tagged(self.tag)
        self.created = False

    # -- entering ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def entered(self, part: str) -> Iterator[None]:
        """While it lasts, the calling thread is in `part`'s namespace (a process it starts
        is born there); the thread's own namespace is put back after. No host: unchanged."""
        host = self.hosts.get(part)
        if host is None:
            yield
            return
        with entered_netns(host.netns_path):
            yield

    def exec_prefix(self, part: str) -> list[str]:
        """argv that runs the rest of an argv in `part`'s namespace, in place (same PID)."""
        host = self.hosts[part]
        nsenter = shutil.which("nsenter") or "nsenter"
        return [nsenter, f"--net={host.netns_path}", "--"]

    # -- what the run shows -----------------------------------------------------------------

    def describe(self) -> str:
        """One line for the console: each part's address, and where they meet."""
        where = ", ".join(f"{part} {host.address}" for part, host in self.hosts.items())
        return (
            f"hosts: {where} (network namespaces {self.tag}-<part>, bridge {self.bridge} "
            f"at {self.bridge_address})"
        )

    @classmethod
    def from_state(cls, state: HostsState) -> HostNetwork:
        """The network another process made, from its `state()` (it is not this one's to
        remove: `remove()` does nothing)."""
        hosts = {
            part: Host(part, host.netns, host.address, host.veth)
            for part, host in state.parts.items()
        }
        network = cls(state.tag, ipaddress.IPv4Network(state.subnet), hosts)
        assert network.bridge == state.bridge, state
        return network

    def state(self) -> HostsState:
        """As stack.json records it (what a test kit needs to reach each host)."""
        return HostsState(
            tag=self.tag,
            subnet=str(self.subnet),
            bridge=self.bridge,
            bridge_address=self.bridge_address,
            parts={
                part: PartHost(netns=host.netns, address=host.address, veth=host.veth)
                for part, host in self.hosts.items()
            },
        )


def bridge_address(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    return subnet.network_address + 1


def free_subnet(
    seed: int, taken: list[ipaddress.IPv4Network], prefixlen: int = 24
) -> ipaddress.IPv4Network:
    """A 10.A.B.0/24 derived from `seed` (A from 64 up: the low 10.x ranges are the ones
    networks tend to use), the next one while it overlaps `taken`."""
    first = seed % (192 * 256)
    for step in range(192 * 256):
        n = (first + step) % (192 * 256)
        subnet = ipaddress.IPv4Network(f"10.{64 + n // 256}.{n % 256}.0/{prefixlen}")
        if not any(subnet.overlaps(route) for route in taken):
            return subnet
    raise HostsError("no free 10.x.y.0/24 for the host network: every one overlaps a route")


def routes() -> list[ipaddress.IPv4Network]:
    """This namespace's IPv4 routes (the default route left out: it overlaps everything)."""
    found = []
    with contextlib.suppress(OSError):
        for line in _ROUTES.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            destination, mask = (int(fields[i], 16).to_bytes(4, "little") for i in (1, 7))
            if mask == bytes(4):
                continue
            found.append(
                ipaddress.IPv4Network(
                    f"{ipaddress.IPv4Address(destination)}/{ipaddress.IPv4Address(mask)}",
                    strict=False,
                )
            )
    return found


def remove_tagged(tag: str) -> list[str]:
    """Removes every namespace and interface named `<tag>-...` (what the run of that tag made,
    or left behind when it was killed); the names removed."""
    removed = []
    prefix = f"{tag}-"
    names = sorted(p.name for p in NETNS_DIR.glob(f"{prefix}*")) if NETNS_DIR.is_dir() else []
    for name in names:
        _ip("netns", "del", name, check=False)
        removed.append(name)
    links = sorted(p.name for p in _SYS_NET.glob(f"{prefix}*"))
    for name in sorted(links, key=lambda n: n.endswith("-br")):  # the bridge last
        _ip("link", "del", name, check=False)
        removed.append(name)
    return removed


def tagged(tag: str) -> list[str]:
    """The namespaces and interfaces named `<tag>-...` that exist now."""
    prefix = f"{tag}-"
    found = [p.name for p in NETNS_DIR.glob(f"{prefix}*")] if NETNS_DIR.is_dir() else []
    return sorted(found + [p.name for p in _SYS_NET.glob(f"{prefix}*")])


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@contextlib.contextmanager
def entered_netns(path: Path) -> Iterator[None]:
    """The calling thread in the network namespace at `path` (an nsfs file) while it lasts,
    then back in its own. Only this thread moves: the rest of the process stays."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(path, os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)  # a thread left in another namespace would be a bug: raise
    finally:
        os.close(own)
