"""torch.distributed transport: each bucket is a `broadcast` from its sender to every receiver.

Process groups. The trainer already runs its own default process group (megatron's), so this
transport never touches `torch.distributed`'s global state (`init_process_group`,
`new_group`, the group registry): it constructs backend objects directly
(`ProcessGroupGloo(store, rank, size, options)`, or `ProcessGroupNCCL` on CUDA) on a
`PrefixStore` of the transfer's own rendezvous TCPStore, which sender 0 hosts at
`spec.rendezvous`. Nothing is registered anywhere, so the groups cannot collide with the
trainer's, and dropping the objects frees them.

One group per sender, not one group of all senders and receivers: group `s` holds sender `s`
(group rank 0) and every receiver (group rank 1 + r) and carries the buckets `s` owns. A single
group would make every sender take part in (and receive a copy of) every other sender's
broadcast and would run the senders in lockstep; with a group per sender each bucket crosses
the network once per receiver and the senders work in parallel. Within a group every member
posts the same broadcasts in the same (plan) order, which is what gloo needs.

Receivers double-buffer: two buffers of the largest bucket; at `recv(i)` the buffer of bucket
`i - 1` is free again and the broadcast of bucket `i + 1` is posted into it, so bucket `i + 1`
streams in while the caller loads bucket `i`.

Lifelines. Besides its group connections, every receiver holds one plain TCP connection to
every sender (the sender listens; the receiver connects before joining the sender's group and
says which receiver it is). After that hello nothing travels on it but a last word before it
closes: `D` (done) or `A` + the reason of an abort. A peer whose process dies closes it without
a word, which the kernel does even for a process killed with SIGKILL. Neither gloo nor the
store can be trusted with this. Gloo's TCP transport fails only the operations still queued on
a connection that closes, not the one whose bytes are in flight on it (its `Pair` keeps that
one out of the list it fails), so a sender, or a surviving receiver, caught mid-bucket by a
death waits for gloo's timeout (measured: in up to half of the runs with 8 MiB buckets); and
with more than two receivers gloo's broadcast tree relays through receivers, so a receiver may
wait on a dead receiver that the sender never talks to. The abort key lives in the store that
sender 0 hosts, which goes when sender 0 dies or, failing, destroys its group (which holds the
last reference), often before the others' next look. TCP keepalive on the lifelines
(`PEER_KEEPALIVE`, 11 s) also catches a peer host that vanishes without closing anything.

Deadlines and failures. Every group is built with `timeout_s` as its operation timeout, and
every wait polls the broadcast against its own deadline of `timeout_s`, so a peer that never
posts a broadcast (absent, hung) fails it within `timeout_s`. Every 0.25 s a wait also looks at
its lifelines (a local `poll`, no round trip) and at the key `abort` of the rendezvous store,
so a direct peer that died or gave up fails it at once, naming that peer; the sender's final
wait for the receivers' confirmations watches them too (a receiver that confirmed may go).
A side that fails sends its reason on every lifeline, records it under `abort` (best effort:
the store lives in sender 0, and goes when sender 0 fails or dies) and destroys its groups,
which closes their connections: gloo's `abort()` and `shutdown()` leave them open
(measured), only the destructor closes them, and it waits for the group's pending broadcasts,
which can be the in-flight ones above that end only at gloo's timeout, so it runs on a daemon
thread. A failure thus spreads over the lifelines, sender -> receivers -> other senders, in
well under a second.

CUDA: with `spec.device == "cuda"` the groups are NCCL and the buffers live on the current CUDA
device. That path is UNTESTED here (no GPU; NCCL also refuses two ranks on one GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import selectors
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from relayrl.core.sockets import apply_tcp_keepalive
from relayrl.dataplane.transports.base import (
    PEER_KEEPALIVE,
    BucketSink,
    BucketSource,
    Deadline,
    TransportError,
    TransportSpec,
    local_address_towards,
    open_rendezvous_store,
    receiver_name,
    sender_name,
    wait_for_keys,
)

if TYPE_CHECKING:
    from torch.distributed import Store, Work
    from torch.distributed.distributed_c10d import ProcessGroup

ABORT_KEY = "abort"
_STORE_TIMEOUT_FOR_ABORT = timedelta(seconds=1)
_WATCH_S = 0.25  # how often a wait looks at the lifelines and the abort key
_RECEIVER_GRACE_S = 2.0  # a receiver waits this much longer for a group than its sender
_ATTRIBUTE_S = 1.0  # after a gloo error: how long to wait for the peer failure behind it
_FIRST_POLL_SLEEP_S = 0.00005
_MAX_POLL_SLEEP_S = 0.001
_FAREWELL_DONE = b"D"
_FAREWELL_ABORT = b"A"
_MAX_FAREWELL_BYTES = 4096  # fits the empty send buffer of a lifeline: sent without blocking
_MAX_HELLO_BYTES = 4096


def _present_key(name: str) -> str:
    return f"present/{name.replace(' ', '')}"


def _done_key(receiver_rank: int) -> str:
    return f"done/receiver{receiver_rank}"


def _closed_key(sender_rank: int) -> str:
    return f"closed/sender{sender_rank}"


def _lifeline_key(sender_rank: int) -> str:
    return f"lifeline/sender{sender_rank}"


def _build_group(
    store: Store, spec: TransportSpec, group_of: int, group_rank: int, who: str
) -> ProcessGroup:
    """The group of sender `group_of` (sender = group rank 0, receiver r = 1 + r); blocks until
    every member has joined, at most `timeout_s` for the sender and a little longer for a
    receiver: the sender, whose store knows who never came, gives up first and says so on the
    lifelines, so a receiver can name the missing member even though the store went down with
    the sender."""
    import torch.distributed as dist

    group_store = dist.PrefixStore(f"group{group_of}/", store)
    size = 1 + spec.num_receivers
    timeout_s = spec.timeout_s if group_rank == 0 else spec.timeout_s + _RECEIVER_GRACE_S
    timeout = timedelta(seconds=timeout_s)
    try:
        if spec.device == "cuda":  # UNTESTED here: needs one GPU per rank
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            return dist.ProcessGroupNCCL(group_store, group_rank, size, nccl_options)
        gloo_options = dist.ProcessGroupGloo._Options()
        gloo_options._timeout = timeout
        # Bind to the interface that reaches the rendezvous host, not whatever the hostname
        # resolves to (gloo's default).
        host = local_address_towards(spec.rendezvous_address[0])
        gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(group_store, group_rank, size, gloo_options)
    except RuntimeError as exc:
        members = [sender_name(group_of)] + [receiver_name(r) for r in range(spec.num_receivers)]
        try:
            missing = [name for name in members if not store.check([_present_key(name)])]
        except RuntimeError:
            missing = []
        absent = f"; never showed up: {', '.join(missing)}" if missing else ""
        raise TransportError(
            f"the process group of {sender_name(group_of)} did not form within "
            f"{timeout_s:g} s{absent} ({exc})",
            transfer_id=spec.transfer_id,
            peer=", ".join(missing) if missing else who,
        ) from exc


def _broadcast(group: ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> Work:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


@dataclasses.dataclass(frozen=True)
class _Failure:
    """Why a wait ended badly: what to say, the peer to blame if known, and the reason a peer
    reported (passed on unchanged as the transfer's root cause)."""

    reason: str
    peer: str | None = None
    root_cause: str | None = None


class _Lifelines:
    """This side's lifelines, one per direct peer: polled without blocking for the ones that
    closed, and closed with a last word."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._heard: dict[socket.socket, bytearray] = {}  # connection -> bytes from the peer

    def __len__(self) -> int:
        """The lifelines still open."""
        return len(self._heard)

    def add(self, peer: str, conn: socket.socket) -> None:
        conn.setblocking(False)
        apply_tcp_keepalive(conn, PEER_KEEPALIVE)
        self._heard[conn] = bytearray()
        self._selector.register(conn, selectors.EVENT_READ, peer)

    def losses(self, wait_s: float = 0.0) -> list[tuple[str, bytes]]:
        """The peers whose lifeline closed since the last call, each with its last word (b""
        when it died without one); waits up to `wait_s` for any lifeline to stir."""
        if not self._heard:
            return []
        lost = []
        for key, _ in self._selector.select(wait_s):
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            if self._read(conn):
                self._selector.unregister(conn)
                lost.append((str(key.data), bytes(self._heard.pop(conn))))
                conn.close()
        return lost

    def _read(self, conn: socket.socket) -> bool:
        """Take what arrived on `conn`; True once the peer closed it (or it broke)."""
        heard = self._heard[conn]
        while True:
            try:
                chunk = conn.recv(1 << 16)
            except BlockingIOError:
                return False
            except OSError:  # reset, or keepalive gave up on the peer's host
                return True
            if not chunk:
                return True
            heard += chunk[: max(0, _MAX_FAREWELL_BYTES - len(heard))]

    def close(self, farewell: bytes) -> None:
        """Say `farewell` on every lifeline (best effort, never blocks) and close them."""
        for conn in list(self._heard):
            with contextlib.suppress(OSError):  # that peer is gone already
                conn.send(farewell[:_MAX_FAREWELL_BYTES])
            # Unread bytes would turn our FIN into a RST, which may drop the farewell.
            with contextlib.suppress(OSError):
                while conn.recv(1 << 16):
                    pass
            self._selector.unregister(conn)
            conn.close()
        self._heard.clear()
        self._selector.close()


def _hello(spec: TransportSpec, receiver_rank: int) -> bytes:
    return json.dumps({"transfer_id": spec.transfer_id, "receiver": receiver_rank}).encode() + b"\n"


def _read_hello(conn: socket.socket, spec: TransportSpec) -> int | None:
    """The receiver rank a new lifeline announces; None if it is not one of this transfer's."""
    data = b""
    while not data.endswith(b"\n") and len(data) < _MAX_HELLO_BYTES:
        chunk = conn.recv(_MAX_HELLO_BYTES - len(data))
        if not chunk:
            return None
        data += chunk
    try:
        hello = json.loads(data)
        rank = hello["receiver"]
        if hello["transfer_id"] != spec.transfer_id or rank not in range(spec.num_receivers):
            return None
    except (ValueError, TypeError, KeyError):
        return None
    return int(rank)


def _connect_lifeline(
    store: Store, spec: TransportSpec, sender_rank: int, receiver_rank: int
) -> socket.socket:
    """Receiver `receiver_rank`'s lifeline to sender `sender_rank`, at most `timeout_s`."""
    deadline = Deadline(spec.timeout_s)
    sender = sender_name(sender_rank)
    key = _lifeline_key(sender_rank)
    wait_for_keys(
        store,
        {key: sender},
        deadline,
        spec=spec,
        waiting_for=f"lifeline address of {sender}",
        abort_key=ABORT_KEY,
    )
    address = store.get(key).decode()
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection(
            (host, int(port)), timeout=max(deadline.remaining_s(), 1e-3)
        )
        conn.sendall(_hello(spec, receiver_rank))
    except OSError as exc:
        raise TransportError(
            f"cannot connect to the lifeline of {sender} at {address} ({exc})",
            transfer_id=spec.transfer_id,
            peer=sender,
        ) from exc
    return conn


class _StoreEndpoint:
    """What both sides share: waiting for a broadcast or for store keys while watching the
    lifelines and the published abort, telling the peers why this side gave up."""

    spec: TransportSpec
    name: str
    _store: Store | None
    _store_reachable: bool
    _lifelines: _Lifelines

    def _wait(self, work: Work) -> _Failure | None:
        """Wait until `work` is done, at most `timeout_s`; None when it succeeded, else why not.

        Polls instead of `work.wait()` so that a lost peer or a published abort ends the wait
        at once (gloo may not fail a broadcast whose peer died; see the module docstring).
        Returns the error rather than raising it so that no traceback keeps `work`, and with it
        the group's connections, alive after an abort."""
        deadline = Deadline(self.spec.timeout_s)
        sleep_s, next_watch = _FIRST_POLL_SLEEP_S, time.monotonic() + _WATCH_S
        while not work.is_completed():
            if time.monotonic() >= next_watch:
                if failure := self._peer_failure():
                    return failure
                next_watch = time.monotonic() + _WATCH_S
            if deadline.expired():
                return _Failure(f"not done within {self.spec.timeout_s:g} s")
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _MAX_POLL_SLEEP_S)
        try:
            work.wait()  # raises the broadcast's own error, if it failed
        except RuntimeError as exc:
            return self._explain(_short_gloo_error(str(exc)))
        return None

    def _explain(self, gloo_error: str) -> _Failure:
        """A failed broadcast, blamed on the peer behind it if one shows up within
        `_ATTRIBUTE_S`: gloo names a peer by its address at best, and a receiver that lost the
        relay of its bucket learns who it was only from the sender's abort."""
        deadline = Deadline(_ATTRIBUTE_S)
        while True:
            failure = self._peer_failure(wait_s=min(_WATCH_S, deadline.remaining_s()))
            if failure is not None:
                return dataclasses.replace(failure, reason=f"{failure.reason}; gloo: {gloo_error}")
            if deadline.expired():
                return _Failure(gloo_error)

    def _wait_for_keys(self, keys: dict[str, str], waiting_for: str) -> None:
        """`wait_for_keys` (key -> the peer that sets it, at most `timeout_s`) that also ends at
        once when a direct peer is lost or aborts."""
        assert self._store is not None
        if not keys:
            return
        deadline = Deadline(self.spec.timeout_s)
        while (slice_s := min(_WATCH_S, deadline.remaining_s())) > 0:
            if failure := self._peer_failure():
                raise TransportError(
                    f"no {waiting_for} ({failure.reason})",
                    transfer_id=self.spec.transfer_id,
                    peer=failure.peer,
                    root_cause=failure.root_cause,
                )
            started = time.monotonic()
            try:
                self._store.wait(list(keys), timedelta(seconds=slice_s))
                return
            except RuntimeError:
                if time.monotonic() - started < 0.9 * slice_s:
                    break  # not a timeout: the store failed, as wait_for_keys will tell
        # Out of time, or the store is gone: wait_for_keys names the peers that did not answer.
        wait_for_keys(
            self._store,
            keys,
            deadline,
            spec=self.spec,
            waiting_for=waiting_for,
            abort_key=ABORT_KEY,
        )

    def _peer_failure(self, wait_s: float = 0.0) -> _Failure | None:
        """A direct peer whose lifeline closed without `D`, or an abort published in the store;
        None if neither (waits up to `wait_s` for a lifeline to stir)."""
        for peer, last_word in self._lifelines.losses(wait_s):
            if last_word.startswith(_FAREWELL_DONE) or self._confirmed(peer):
                continue
            if last_word.startswith(_FAREWELL_ABORT):
                reason = last_word[len(_FAREWELL_ABORT) :].decode(errors="replace")
                return _Failure(f"{peer} aborted: {reason}", peer, root_cause=reason)
            return _Failure(
                f"lost {peer}: its connection to {self.name} closed without a word "
                "(its process died)",
                peer,
            )
        if reason := self._published_abort():
            return _Failure(f"a peer aborted: {reason}", root_cause=reason)
        return None

    def _confirmed(self, peer: str) -> bool:
        """Whether `peer` confirmed the transfer, so that losing it no longer matters."""
        return False

    def _published_abort(self) -> str:
        """The reason a peer published under the abort key, or "" (also when the store's host
        is gone: then the lifelines tell the story)."""
        if self._store is None or not self._store_reachable:
            return ""
        try:
            if self._store.check([ABORT_KEY]):
                return self._store.get(ABORT_KEY).decode()
        except RuntimeError:
            self._store_reachable = False  # sender 0 is gone; do not ask again
        return ""

    def _tell_peers(self, reason: str) -> None:
        """Best effort: `reason` on every lifeline (at once), then under the abort key."""
        self._lifelines.close(_FAREWELL_ABORT + reason.encode())
        if self._store is None or not self._store_reachable:
            return
        try:
            self._store.set_timeout(_STORE_TIMEOUT_FOR_ABORT)
            if not self._store.check([ABORT_KEY]):
                self._store.set(ABORT_KEY, reason)
        except RuntimeError:
            self._store_reachable = False  # the lifelines told the direct peers anyway


class TorchDistributedSink(_StoreEndpoint, BucketSink):
    """Sender `sender_rank`: hosts the rendezvous store if it is sender 0, listens for the
    receivers' lifelines, builds its group."""

    def __init__(self, spec: TransportSpec, sender_rank: int) -> None:
        super().__init__(spec, sender_rank)
        self._store, self._store_reachable = None, True
        self._lifelines = _Lifelines()
        self._listener: socket.socket | None = None
        self._group: ProcessGroup | None = None
        self._done_keys = {receiver_name(r): _done_key(r) for r in range(spec.num_receivers)}
        try:
            self._store = open_rendezvous_store(spec, host_it=sender_rank == 0, who=self.name)
            self._store.set(_present_key(self.name), "1")
            self._listen()
            # Lifelines first: if a receiver never comes, those that did hear who it was.
            self._accept_lifelines()
            self._group = _build_group(self._store, spec, sender_rank, 0, self.name)
        except BaseException as exc:
            self._fail_set_up(exc)
            raise

    def _listen(self) -> None:
        assert self._store is not None
        host = local_address_towards(self.spec.rendezvous_address[0])
        self._listener = socket.create_server((host, 0), backlog=self.spec.num_receivers)
        port = self._listener.getsockname()[1]
        self._store.set(_lifeline_key(self.sender_rank), f"{host}:{port}")

    def _accept_lifelines(self) -> None:
        """One lifeline from every receiver (each connects before it joins the group), at most
        `timeout_s`; a TransportError names the receivers that never connected."""
        assert self._listener is not None
        deadline = Deadline(self.spec.timeout_s)
        joined: set[int] = set()
        while len(joined) < self.spec.num_receivers:
            try:
                self._listener.settimeout(max(deadline.remaining_s(), 0.001))
                conn, _ = self._listener.accept()
                conn.settimeout(max(deadline.remaining_s(), 0.001))
                rank = _read_hello(conn, self.spec)
            except OSError as exc:
                missing = [
                    receiver_name(r) for r in range(self.spec.num_receivers) if r not in joined
                ]
                raise TransportError(
                    f"no lifeline from {', '.join(missing)} within {self.spec.timeout_s:g} s "
                    f"({exc})",
                    transfer_id=self.spec.transfer_id,
                    peer=", ".join(missing),
                ) from exc
            if rank is None or rank in joined:
                conn.close()  # not a receiver of this transfer
                continue
            joined.add(rank)
            self._lifelines.add(receiver_name(rank), conn)
        self._listener.close()
        self._listener = None

    def _confirmed(self, peer: str) -> bool:
        key = self._done_keys.get(peer)
        if key is None or self._store is None or not self._store_reachable:
            return False
        try:
            return bool(self._store.check([key]))
        except RuntimeError:
            return False

    def _send(self, index: int, data: torch.Tensor) -> None:
        assert self._group is not None
        failure = self._wait(_broadcast(self._group, data, self.spec.timeout_s))
        if failure is not None:
            raise TransportError(
                f"broadcast to the receivers failed ({failure.reason})",
                transfer_id=self.spec.transfer_id,
                bucket_index=index,
                peer=failure.peer or f"{self.name} -> receivers",
                root_cause=failure.root_cause,
            )

    def _finish(self) -> None:
        assert self._store is not None
        done = {_done_key(r): receiver_name(r) for r in range(self.spec.num_receivers)}
        self._wait_for_keys(done, "confirmation that every bucket arrived")
        if self.sender_rank != 0:
            self._store.set(_closed_key(self.sender_rank), "1")
        else:
            # Sender 0 hosts the store: keep it up until the other senders are through with it.
            others = {_closed_key(s): sender_name(s) for s in range(1, self.spec.num_senders)}
            self._wait_for_keys(others, "close of the other senders")
        self._lifelines.close(_FAREWELL_DONE)
        self._group = None
        self._store = None

    def _abort(self, reason: str) -> None:
        self._tell_peers(reason)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        # Only destroying a gloo group closes its connections (abort() and shutdown() leave
        # them open, so peers would wait for their deadline); its destructor first waits for
        # the group's pending broadcasts, which end only once the peers give up too.
        objects: list[object] = [self._group]
        self._group = None  # before the thread starts: it must hold the last reference
        _drop_in_background(objects)
        self._store = None


class TorchDistributedSource(_StoreEndpoint, BucketSource):
    """Receiver `receiver_rank`: a lifeline to and the group of every sender, double-buffers
    the buckets."""

    def __init__(self, spec: TransportSpec, receiver_rank: int) -> None:
        super().__init__(spec, receiver_rank)
        self._store, self._store_reachable = None, True
        self._lifelines = _Lifelines()
        self._groups: list[ProcessGroup] = []
        self._pending: dict[int, Work] = {}
        self._buffers: list[torch.Tensor] = []
        try:
            self._store = open_rendezvous_store(spec, host_it=False, who=self.name)
            self._store.set(_present_key(self.name), "1")
            for s in range(spec.num_senders):
                lifeline = _connect_lifeline(self._store, spec, s, receiver_rank)
                self._lifelines.add(sender_name(s), lifeline)
                self._groups.append(self._join_group(s))
            device = torch.device(spec.device) if spec.device == "cpu" else _current_cuda()
            self._buffers = [
                torch.empty(spec.max_bucket_bytes, dtype=torch.uint8, device=device)
                for _ in range(2)
            ]
            for index in range(min(2, spec.num_buckets)):
                self._post(index)
        except BaseException as exc:
            self._fail_set_up(exc)
            raise

    def _join_group(self, sender_rank: int) -> ProcessGroup:
        """The group of sender `sender_rank`. When it does not form, the sender has usually
        given up first and taken the store, and with it the names of the members that never
        came, down: its abort, on the lifeline, says who they were."""
        assert self._store is not None
        try:
            return _build_group(
                self._store, self.spec, sender_rank, 1 + self.receiver_rank, self.name
            )
        except TransportError as exc:
            failure = self._peer_failure(wait_s=_ATTRIBUTE_S)
            if failure is None or failure.root_cause is None:
                raise
            raise TransportError(
                f"the process group of {sender_name(sender_rank)} did not form ({failure.reason})",
                transfer_id=self.spec.transfer_id,
                peer=failure.peer,
                root_cause=failure.root_cause,
            ) from exc

    def _view(self, index: int) -> torch.Tensor:
        return self._buffers[index % 2][: self.spec.bucket_sizes[index]]

    def _post(self, index: int) -> None:
        group = self._groups[self.spec.owner_of(index)]
        self._pending[index] = _broadcast(group, self._view(index), self.spec.timeout_s)

    def _recv(self, index: int) -> torch.Tensor:
        # The caller is done with bucket index - 1: its buffer takes bucket index + 1.
        if index >= 1 and index + 1 < self.spec.num_buckets:
            self._post(index + 1)
        owner = sender_name(self.spec.owner_of(index))
        failure = self._wait(self._pending.pop(index))
        if failure is not None:
            raise TransportError(
                f"broadcast from {owner} failed ({failure.reason})",
                transfer_id=self.spec.transfer_id,
                bucket_index=index,
                peer=failure.peer or f"{owner} -> {self.name}",
                root_cause=failure.root_cause,
            )
        if index == self.spec.num_buckets - 1:
            assert self._store is not None
            self._store.set(_done_key(self.receiver_rank), "1")
        return self._view(index)

    def _finish(self) -> None:
        self._lifelines.close(_FAREWELL_DONE)
        self._release()

    def _abort(self, reason: str) -> None:
        self._tell_peers(reason)
        objects: list[object] = [self._groups, self._pending, self._buffers]
        # Emptied before the thread starts: it must hold the last references.
        self._groups, self._pending, self._buffers = [], {}, []
        _drop_in_background(objects)
        self._release()

    def _release(self) -> None:
        self._pending.clear()
        self._groups = []
        self._buffers = []
        self._store = None


def _drop_in_background(objects: list[Any]) -> None:
    """Let go of `objects` (emptying the list), first to last, on a daemon thread: a gloo
    group's destructor waits for its pending broadcasts, which end only once the peers give up
    too. The caller must hold no other reference."""
    holder = list(objects)
    objects.clear()

    def release_in_order() -> None:
        while holder:
            del holder[0]

    threading.Thread(target=release_in_order, name="weightsync-release", daemon=True).start()


def _short_gloo_error(text: str) -> str:
    """Gloo's message without its source location and its generic advice."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return re.sub(r"\.? This is typically caused by .*$", "", text, flags=re.DOTALL)


def _current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
