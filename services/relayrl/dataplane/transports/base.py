"""The interface of the weight-sync data plane.

A transfer moves one policy version as a sequence of byte buckets (the bucket plan: bucket `i`
has `bucket_sizes[i]` bytes; both sides know the plan). Bucket `i` is sent by sender
`i % num_senders` (every sender holds the whole exported model but sends only its share) and
every receiver gets every bucket, in plan order.

    sink = open_sink(spec, sender_rank)          # trainer rank
    for index in spec.buckets_of(sender_rank):
        sink.send(index, bucket_uint8)           # returns once `bucket_uint8` may be reused
    sink.close()                                 # waits until every receiver has every bucket

    source = open_source(spec, receiver_rank)    # engine worker
    for index in range(spec.num_buckets):
        view = source.recv(index)                # valid until the next recv()
        load(view)
    source.close()

Every wait has a deadline (`spec.timeout_s`, per wait): a peer that never shows up, dies or
hangs ends the transfer with a `TransportError` that names the transfer, the bucket and the
peer. A failure on one side is passed on to the peers it can still reach, so they fail at once
instead of at their own deadline. A bucket whose size differs from the plan fails at once.
Senders wait for receivers to free a buffer, so `timeout_s` must also cover the longest a
receiver's caller spends between two `recv()` calls (loading a bucket).

The rendezvous TCPStore that sender 0 hosts listens on every interface, like Mooncake.

Backends are picked through the one table `TRANSPORTS` and imported only when a spec names
them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import math
import socket
import time
from collections import deque
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, Self

import torch

from relayrl.core.config import TcpKeepaliveConfig
from relayrl.core.dotted import import_object

if TYPE_CHECKING:
    from torch.distributed import Store

# name -> (sink class, source class) as `module:Class` paths, imported on first use.
TRANSPORTS: Final[dict[str, tuple[str, str]]] = {
    "torch_distributed": (
        "relayrl.dataplane.transports.torch_distributed:TorchDistributedSink",
        "relayrl.dataplane.transports.torch_distributed:TorchDistributedSource",
    ),
    "mooncake": (
        "relayrl.dataplane.transports.mooncake:MooncakeSink",
        "relayrl.dataplane.transports.mooncake:MooncakeSource",
    ),
}

DEVICE_TYPES: Final = ("cpu", "cuda")
MOONCAKE_PROTOCOLS: Final = ("tcp", "rdma")

# TCP keepalive on the connections between peers of a transfer (torch_distributed's lifelines,
# Mooncake's control channels): a peer host that vanishes (no FIN, no RST) is declared lost
# after `silent_peer_s` (11 s); the kernel answers probes even when the peer process is too
# busy to run, so a loaded peer is never taken for a dead one.
PEER_KEEPALIVE: Final = TcpKeepaliveConfig(idle_s=5, interval_s=2, probes=3)


class TransportError(RuntimeError):
    """The data plane failed: a peer is missing, died, hung past the deadline, aborted, or a
    bucket does not match the plan. `str()` names the transfer, the bucket and the peer."""

    boundary: ClassVar[str] = "transport"

    def __init__(
        self,
        reason: str,
        *,
        transfer_id: str,
        bucket_index: int | None = None,
        peer: str | None = None,
        root_cause: str | None = None,
    ) -> None:
        where = [f"weight-sync transfer {transfer_id!r}"]
        if bucket_index is not None:
            where.append(f"bucket {bucket_index}")
        if peer:
            where.append(peer)
        super().__init__(f"{', '.join(where)}: {reason}")
        self.reason = reason
        self.transfer_id = transfer_id
        self.bucket_index = bucket_index
        self.peer = peer
        self._root_cause = root_cause

    @property
    def root_cause(self) -> str:
        """The first failure of the transfer: what a peer that aborted reported, or this error
        itself. Passed on to the other peers, so an abort does not nest one message per hop."""
        return self._root_cause or str(self)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TransportSpec:
    """Everything both sides of one transfer agree on; passed to the engine as JSON."""

    type: str
    """Backend name, a key of `TRANSPORTS`: "torch_distributed" or "mooncake"."""
    transfer_id: str
    """Unique per transfer (e.g. "<version>-<attempt>"); namespaces the rendezvous keys."""
    num_senders: int
    """Trainer ranks that send; bucket i is sent by sender i % num_senders."""
    num_receivers: int
    """Engine workers that receive; each gets every bucket."""
    bucket_sizes: tuple[int, ...]
    """Bytes of each bucket, in plan order (a list is accepted and stored as a tuple)."""
    rendezvous: str
    """host:port of the rendezvous TCPStore; sender 0 hosts it, everyone else connects."""
    timeout_s: float = 60.0
    """Deadline of every single wait (peer arrival, one bucket, the final confirmation)."""
    device: str = "cpu"
    """Where the buckets live: "cpu" (gloo / Mooncake TCP) or "cuda" (nccl; untested here)."""
    mooncake_protocol: str = "tcp"
    """Mooncake transport protocol: "tcp" (works anywhere) or "rdma" (needs RDMA NICs)."""
    mooncake_device_name: str = ""
    """Mooncake device filter (comma-separated RDMA devices); empty lets it discover them."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_sizes, list | tuple):
            object.__setattr__(self, "bucket_sizes", tuple(self.bucket_sizes))
        if self.type not in TRANSPORTS:
            raise ValueError(
                f"transport type {self.type!r} is unknown: use one of {list(TRANSPORTS)}"
            )
        if not isinstance(self.transfer_id, str) or not self.transfer_id:
            raise ValueError("transfer_id must be a non-empty string (e.g. '<version>-<attempt>')")
        for name in ("num_senders", "num_receivers"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.bucket_sizes, tuple) or not self.bucket_sizes:
            raise ValueError("bucket_sizes must be a non-empty list of byte counts")
        for index, size in enumerate(self.bucket_sizes):
            if not _is_int(size) or size < 1:
                raise ValueError(f"bucket_sizes[{index}] must be an integer >= 1, got {size!r}")
        self.rendezvous_address  # noqa: B018 - validates host:port
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if self.device not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {list(DEVICE_TYPES)}, got {self.device!r}")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(
                f"mooncake_protocol must be one of {list(MOONCAKE_PROTOCOLS)}, "
                f"got {self.mooncake_protocol!r}"
            )

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def max_bucket_bytes(self) -> int:
        return max(self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        """`rendezvous` split into (host, port); "[::1]:29500" gives ("::1", 29500)."""
        host, colon, port = str(self.rendezvous).rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rendezvous must be host:port, got {self.rendezvous!r}")
        return host, int(port)

    def owner_of(self, index: int) -> int:
        """The sender rank that sends bucket `index`."""
        return index % self.num_senders

    def buckets_of(self, sender_rank: int) -> range:
        """The bucket indices sender `sender_rank` sends, in the order it sends them."""
        return range(sender_rank, self.num_buckets, self.num_senders)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TransportSpec:
        fields: Any = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("a TransportSpec JSON document must be an object")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown TransportSpec fields {unknown}: known are {sorted(known)}")
        try:
            return cls(**fields)
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"invalid TransportSpec JSON: {exc}") from None


def sender_name(rank: int) -> str:
    return f"sender {rank}"


def receiver_name(rank: int) -> str:
    return f"receiver {rank}"


class Deadline:
    """A point in monotonic time; every blocking call gets what is left of it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def remaining(self) -> timedelta:
        # TCPStore rejects a zero timeout; a millisecond is "now".
        return timedelta(seconds=max(self.remaining_s(), 0.001))


def local_address_towards(host: str) -> str:
    """The local IPv4 address the kernel routes to `host` from; the address peers reach us on
    (a UDP connect() sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def open_rendezvous_store(spec: TransportSpec, *, host_it: bool, who: str) -> Store:
    """The transfer's key space on the rendezvous TCPStore. Sender 0 (`host_it`) hosts the
    store at `spec.rendezvous`; everyone else connects, waiting up to `timeout_s` for it."""
    from torch.distributed import PrefixStore, TCPStore

    host, port = spec.rendezvous_address
    try:
        store = TCPStore(
            host,
            port,
            None,
            host_it,
            timedelta(seconds=spec.timeout_s),
            wait_for_workers=False,
        )
    except RuntimeError as exc:  # torch's DistNetworkError / DistStoreError
        action = "host" if host_it else "reach"
        raise TransportError(
            f"cannot {action} the rendezvous store at {spec.rendezvous} within "
            f"{spec.timeout_s:g} s ({exc})",
            transfer_id=spec.transfer_id,
            peer=who if host_it else f"{sender_name(0)} (rendezvous host)",
        ) from exc
    return PrefixStore(f"relayrl/weightsync/{spec.transfer_id}/", store)


def wait_for_keys(
    store: Store,
    keys: dict[str, str],
    deadline: Deadline,
    *,
    spec: TransportSpec,
    waiting_for: str,
    bucket_index: int | None = None,
    abort_key: str | None = None,
    who: str | None = None,
) -> None:
    """Wait until every key of `keys` (key -> the peer that sets it) is set; a TransportError
    naming the peers that did not set theirs otherwise. With `abort_key`, a peer that sets it
    (to its reason) ends the wait early, and `who` (this side's name) acknowledges having read
    it (`abort_seen_key`), so that a store host that aborted knows it may go."""
    failure: RuntimeError | None = None
    while failure is None or not deadline.expired():
        # Wait in slices when watching for an abort: TCPStore cannot wait for "any of".
        slice_s = deadline.remaining_s() if abort_key is None else min(deadline.remaining_s(), 0.5)
        started = time.monotonic()
        try:
            store.wait(list(keys), timedelta(seconds=max(slice_s, 0.001)))
            return
        except RuntimeError as exc:
            failure = exc
        if abort_key is not None and _store_has(store, abort_key):
            reason = store.get(abort_key).decode()
            if who is not None:
                acknowledge_abort(store, abort_key, who)
            raise TransportError(
                f"no {waiting_for}: a peer aborted: {reason}",
                transfer_id=spec.transfer_id,
                bucket_index=bucket_index,
                root_cause=reason,
            ) from failure
        if time.monotonic() - started < 0.9 * slice_s:
            break  # not a timeout: the store itself failed
    try:
        missing = [peer for key, peer in keys.items() if not store.check([key])]
    except RuntimeError:  # the store itself is gone: its host (sender 0) died
        missing = []
    peers = ", ".join(missing) if missing else "the rendezvous host (sender 0)"
    detail = "" if deadline.expired() else f" ({failure})"  # a timeout says nothing more
    raise TransportError(
        f"no {waiting_for} within {spec.timeout_s:g} s{detail}",
        transfer_id=spec.transfer_id,
        bucket_index=bucket_index,
        peer=peers,
    ) from failure


def _store_has(store: Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def abort_seen_key(abort_key: str, who: str) -> str:
    """The key by which `who` says it has read the reason published under `abort_key`."""
    return f"{abort_key}/seen/{who}"


def acknowledge_abort(store: Store, abort_key: str, who: str) -> None:
    """Best effort: tell the store's host that `who` has read the abort reason."""
    with contextlib.suppress(RuntimeError):  # the host is gone already: nothing to tell
        store.set(abort_seen_key(abort_key, who), "1")


def check_bucket(spec: TransportSpec, index: int, data: object, who: str) -> torch.Tensor:
    """`data` as the bucket tensor of `index`: 1-D, contiguous uint8 of exactly the planned
    size on the spec's device type; TransportError otherwise."""
    if not isinstance(data, torch.Tensor):
        raise TransportError(
            f"bucket data must be a torch.Tensor, got {type(data).__name__}",
            transfer_id=spec.transfer_id,
            bucket_index=index,
            peer=who,
        )
    problem = None
    if data.dtype != torch.uint8 or data.dim() != 1:
        problem = f"must be a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}"
    elif not data.is_contiguous():
        problem = "must be contiguous"
    elif data.device.type != spec.device:
        problem = f"is on {data.device} but the spec says device={spec.device!r}"
    elif data.numel() != spec.bucket_sizes[index]:
        problem = f"has {data.numel()} bytes but the plan says {spec.bucket_sizes[index]}"
    if problem is not None:
        raise TransportError(
            f"bucket data {problem}",
            transfer_id=spec.transfer_id,
            bucket_index=index,
            peer=who,
        )
    return data


class _Endpoint(abc.ABC):
    """What sinks and sources share: the failure that ended the transfer and closing."""

    def __init__(self, spec: TransportSpec, name: str) -> None:
        self.spec = spec
        self.name = name
        self._failure: TransportError | None = None
        self._closed = False

    def _error(self, reason: str, index: int | None = None) -> TransportError:
        return TransportError(
            reason, transfer_id=self.spec.transfer_id, bucket_index=index, peer=self.name
        )

    def _ensure_usable(self, index: int) -> None:
        if self._closed:
            raise self._error("used after close()", index)
        if self._failure is not None:
            raise self._error(f"the transfer already failed: {self._failure}", index)

    def _fail(self, exc: BaseException) -> None:
        """Record why the transfer ended and tell the peers (never raises)."""
        if self._failure is not None:
            return
        if isinstance(exc, TransportError):
            self._failure = exc
        elif isinstance(exc, GeneratorExit):  # a generator around recv() was closed early
            self._failure = self._error("the caller stopped taking buckets (its load failed)")
        else:
            self._failure = self._error(f"{type(exc).__name__}: {exc}")
        self._abort(self._failure.root_cause)

    def _fail_set_up(self, exc: BaseException) -> None:
        """Setting up failed: tell the peers and release everything (no close() will come)."""
        self._fail(exc)
        self._closed = True
        self._dispose()

    def close(self) -> None:
        """After a complete transfer: wait (up to timeout_s) for the peers to confirm, then
        release everything. Otherwise: tell the peers the transfer is over and release."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failure is None and self._complete():
                try:
                    self._finish()
                except BaseException as exc:
                    self._fail(exc)
                    raise
            elif self._failure is None:
                self._fail(self._error(self._incomplete_reason()))
            else:  # aborted when it failed; release whatever is left
                self._abort(self._failure.root_cause)
        finally:
            self._dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None and not self._closed:
            self._fail(exc)
        self.close()

    @abc.abstractmethod
    def _complete(self) -> bool: ...

    @abc.abstractmethod
    def _incomplete_reason(self) -> str: ...

    @abc.abstractmethod
    def _finish(self) -> None:
        """Complete transfer: wait for the peers' confirmation, release resources."""

    @abc.abstractmethod
    def _abort(self, reason: str) -> None:
        """Failed transfer: tell the reachable peers `reason` and release what they wait on
        (connections, groups), at once. Idempotent, best effort, never raises."""

    def _dispose(self) -> None:  # noqa: B027 - a hook: most backends have nothing slow
        """At close, after `_finish` or `_abort`: release what is slow to release."""

    @classmethod
    def kept_resources(cls, spec: TransportSpec) -> dict[str, Any]:
        """What a process that uses this backend often keeps across transfers, as keyword
        arguments of `open_sink` / `open_source` (see `KeptResources`); none by default."""
        return {}


class BucketSink(_Endpoint):
    """Sender side of one transfer: `send` this sender's buckets in plan order, then `close`."""

    def __init__(self, spec: TransportSpec, sender_rank: int) -> None:
        if not _is_int(sender_rank) or not 0 <= sender_rank < spec.num_senders:
            raise ValueError(f"sender_rank must be in [0, {spec.num_senders}), got {sender_rank!r}")
        super().__init__(spec, sender_name(sender_rank))
        self.sender_rank = sender_rank
        self._unsent = deque(spec.buckets_of(sender_rank))

    def send(self, index: int, data: torch.Tensor) -> None:
        """Send bucket `index` (1-D uint8, exactly the planned size) to every receiver; returns
        once `data` may be reused."""
        self._ensure_usable(index)
        try:
            self._check_index(index)
            check_bucket(self.spec, index, data, self.name)
            self._send(index, data)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._unsent.popleft()

    def _check_index(self, index: int) -> None:
        if not _is_int(index) or not 0 <= index < self.spec.num_buckets:
            raise self._error(f"no bucket {index!r} in a plan of {self.spec.num_buckets}")
        if self.spec.owner_of(index) != self.sender_rank:
            raise self._error(
                f"bucket {index} is sent by sender {self.spec.owner_of(index)} "
                f"(bucket i goes from sender i % {self.spec.num_senders})",
                index,
            )
        if not self._unsent or index != self._unsent[0]:
            expected = self._unsent[0] if self._unsent else "none (all sent)"
            raise self._error(f"buckets go in plan order: the next one is {expected}", index)

    def _complete(self) -> bool:
        return not self._unsent

    def _incomplete_reason(self) -> str:
        return f"closed before sending bucket {self._unsent[0]}"

    @abc.abstractmethod
    def _send(self, index: int, data: torch.Tensor) -> None: ...


class BucketSource(_Endpoint):
    """Receiver side of one transfer: `recv` every bucket in plan order, then `close`."""

    def __init__(self, spec: TransportSpec, receiver_rank: int) -> None:
        if not _is_int(receiver_rank) or not 0 <= receiver_rank < spec.num_receivers:
            raise ValueError(
                f"receiver_rank must be in [0, {spec.num_receivers}), got {receiver_rank!r}"
            )
        super().__init__(spec, receiver_name(receiver_rank))
        self.receiver_rank = receiver_rank
        self._next_index = 0

    def recv(self, index: int) -> torch.Tensor:
        """Bucket `index` as a 1-D uint8 view of a receive buffer, valid until the next recv()
        (or close()); buckets come in plan order."""
        self._ensure_usable(index)
        try:
            if index != self._next_index:
                raise self._error(
                    f"buckets arrive in plan order: the next one is {self._next_index}", index
                )
            view = self._recv(index)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._next_index += 1
        return view

    def _complete(self) -> bool:
        return self._next_index == self.spec.num_buckets

    def _incomplete_reason(self) -> str:
        return f"closed before receiving bucket {self._next_index}"

    @abc.abstractmethod
    def _recv(self, index: int) -> torch.Tensor: ...


def open_sink(spec: TransportSpec, sender_rank: int, **resources: Any) -> BucketSink:
    """The sender side of `spec` for trainer rank `sender_rank`; blocks until the transfer is
    set up (every receiver reachable), at most `spec.timeout_s` per wait. `resources` go to the
    backend: mooncake takes `engine=MooncakeEngine(...)` to reuse one across transfers."""
    sink_path, _ = TRANSPORTS[spec.type]
    sink_class = import_object(sink_path, what=f"{spec.type} transport")
    return sink_class(spec, sender_rank, **resources)


def open_source(spec: TransportSpec, receiver_rank: int, **resources: Any) -> BucketSource:
    """The receiver side of `spec` for engine worker `receiver_rank`; blocks until the transfer
    is set up (every sender connected), at most `spec.timeout_s` per wait. `resources` as for
    `open_sink`."""
    _, source_path = TRANSPORTS[spec.type]
    source_class = import_object(source_path, what=f"{spec.type} transport")
    return source_class(spec, receiver_rank, **resources)


class KeptResources:
    """What one process (weight-sync, an engine worker) keeps across transfers, per backend:
    built by the backend's `kept_resources` on the first transfer that names it (Mooncake: one
    engine, which costs about a second to stop), passed to every later one, closed by `close`."""

    def __init__(self, role: Literal["sink", "source"]) -> None:
        self._role = role
        self._by_type: dict[str, dict[str, Any]] = {}

    def for_spec(self, spec: TransportSpec) -> dict[str, Any]:
        """The keyword arguments for `open_sink` / `open_source` of `spec`."""
        kept = self._by_type.get(spec.type)
        if kept is None:
            sink_path, source_path = TRANSPORTS[spec.type]
            path = sink_path if self._role == "sink" else source_path
            backend = import_object(path, what=f"{spec.type} transport")
            kept = self._by_type[spec.type] = backend.kept_resources(spec)
        return kept

    def close(self) -> None:
        for kept in self._by_type.values():
            for resource in kept.values():
                resource.close()
        self._by_type.clear()
