"""Mooncake transport: senders write buckets straight into the receivers' registered buffers
with the Mooncake transfer engine (TCP here, RDMA on clusters), with `P2PHANDSHAKE` metadata
(no etcd / metadata server).

Set-up. Sender 0 hosts the rendezvous TCPStore at `spec.rendezvous`. Each receiver starts an
engine, registers two buffers of the largest bucket (double buffering: bucket i goes into slot
i % 2), opens a control listener and publishes `{session, slot addresses, control address}`
under `receiver/<r>`. Each sender starts its own engine, and for every receiver reads that key
and connects to its control listener (HELLO carries the sender rank and the transfer id).

Control channel (one TCP connection per sender x receiver, framed messages):
    receiver -> owner of bucket j   FREE j    slot j % 2 may take bucket j (j < 2 at set-up;
                                              bucket j + 1 when the caller asks for bucket j,
                                              i.e. is done with the view of bucket j - 1)
    sender   -> every receiver      READY j   bucket j is in slot j % 2
    receiver -> every sender        DONE      every bucket arrived (after the last READY)
    either   -> the other side      ABORT why the transfer is over, and why
A sender writes bucket j once every receiver granted FREE j: it submits one write per receiver
and polls them (so that the deadline is ours and no core spins), then sends READY j.

Failures. A peer that dies closes its control connections, which its partners see at once; a
failing side sends ABORT with its reason to everyone it is connected to, so the others fail at
once instead of at their deadline; a peer host that vanishes without closing anything is
caught by TCP keepalive on the control channels (`PEER_KEEPALIVE`, 11 s), and a peer that
hangs by the deadline (`timeout_s` per wait). Mooncake listens on every interface even when
given 127.0.0.1, so tests run it in a private network namespace.

Engines. Each sink or source starts its own Mooncake engine (a millisecond) and destroys it
at close, which takes about a second with the GIL held; a process that syncs weights often
should keep one `MooncakeEngine` and pass it as `engine=` to `open_sink` / `open_source`.

Host memory only: buckets must be CPU tensors (the non-CUDA Mooncake build moves host memory);
RDMA (`mooncake_protocol="rdma"`) is untested here. Mooncake logs through glog to stderr (INFO
lines per engine start and stop).
"""

from __future__ import annotations

import abc
import contextlib
import json
import selectors
import socket
import struct
import time
from collections.abc import Callable
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
    abort_seen_key,
    acknowledge_abort,
    local_address_towards,
    open_rendezvous_store,
    receiver_name,
    sender_name,
    wait_for_keys,
)

if TYPE_CHECKING:
    from torch.distributed import Store

HELLO, FREE, READY, DONE, ABORT = 1, 2, 3, 4, 5
_KIND_NAMES = {HELLO: "HELLO", FREE: "FREE", READY: "READY", DONE: "DONE", ABORT: "ABORT"}
_HEADER = struct.Struct("!BqI")  # kind, bucket index (or sender rank for HELLO), payload bytes
_MAX_PAYLOAD_BYTES = 1 << 16
ABORT_KEY = "abort"
_SEND_TIMEOUT_FOR_ABORT_S = 1.0
_STORE_TIMEOUT_FOR_ABORT = timedelta(seconds=1)
# How long sender 0, aborting during set-up, keeps the store up for the peers that can only
# learn why from it (they look every half second).
_ABORT_LINGER = timedelta(seconds=2)
_POLL_SLEEP_S = 0.0002
# Mooncake's Python binding reports a failed submit as -1 cast to an unsigned batch id, or 0.
_FAILED_BATCH_IDS = (0, -1, (1 << 64) - 1)

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
    "(and the Debian packages libibverbs1 librdmacm1)"
)


def _receiver_key(rank: int) -> str:
    return f"receiver/{rank}"


def _closed_key(sender_rank: int) -> str:
    return f"closed/sender{sender_rank}"


def _store_has(store: Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:  # the store's host is gone
        return False


class MooncakeEngine:
    """A Mooncake transfer engine, and on a receiver its two registered receive slots, that a
    process may keep across transfers: pass it as `engine=` to `open_sink` / `open_source`.

    Starting an engine takes a millisecond, but destroying one takes about a second with the
    GIL held (measured: its threads stop on a timer), which an engine worker should not pay on
    every weight update. Without `engine=`, each sink or source starts its own and destroys it
    when it closes. One transfer at a time per engine; host memory only. Receive slots are
    reused while big enough (with TCP, re-registered buffers at new addresses are found by the
    peers; RDMA re-registration is untested here).
    """

    def __init__(self, host: str, *, protocol: str = "tcp", device_name: str = "") -> None:
        """Start an engine that peers reach at `host` (an address of this machine). Mooncake
        listens on every interface whatever `host` says."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                f"the Mooncake transfer engine is not installed ({exc}): {INSTALL_HINT}"
            ) from exc
        self.host = host
        self.protocol = protocol
        self.engine: Any = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"the Mooncake engine failed to start on {host} with protocol {protocol!r} "
                f"(rc={rc})"
            )
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._slots: list[torch.Tensor] = []
        self._keep_alive: list[Any] = []
        self.in_use_by: str | None = None

    def receive_slots(self, num_bytes: int) -> list[torch.Tensor]:
        """Two registered host buffers of at least `num_bytes`, reused while big enough."""
        if self._slots and self._slots[0].numel() >= num_bytes:
            return self._slots
        self._unregister_slots()
        slots = [torch.empty(num_bytes, dtype=torch.uint8) for _ in range(2)]
        for slot in slots:
            rc = self.engine.register_memory(slot.data_ptr(), slot.numel())
            if rc != 0:
                raise RuntimeError(f"Mooncake could not register a receive slot (rc={rc})")
            self._slots.append(slot)
        return self._slots

    def _unregister_slots(self) -> None:
        for slot in self._slots:
            self.engine.unregister_memory(slot.data_ptr())
        self._slots = []

    def keep_until_closed(self, memory: tuple[Any, ...]) -> None:
        """Hold `memory` (sources of writes abandoned mid-flight) until the engine is gone."""
        self._keep_alive.extend(memory)

    def close(self) -> None:
        """Destroy the engine (about a second, with the GIL held), then free the memory it
        served."""
        if self.engine is None:
            return
        self._unregister_slots()
        self.engine = None  # the destructor runs here, while the memory below still exists
        self._keep_alive = []


class _Channel:
    """One control connection: framed messages out, buffered and parsed messages in."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        apply_tcp_keepalive(sock, PEER_KEEPALIVE)  # a vanished host: an error, not the deadline
        self.sock = sock
        self.peer = peer
        self.peer_closed = False
        self._buffer = bytearray()

    def send(self, kind: int, index: int = 0, payload: bytes = b"", *, timeout_s: float) -> None:
        self.sock.settimeout(max(timeout_s, 0.001))
        self.sock.sendall(_HEADER.pack(kind, index, len(payload)) + payload)

    def read_available(self) -> list[tuple[int, int, bytes]]:
        """The complete messages that arrived (call when the socket is readable); sets
        `peer_closed` on EOF."""
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            self.peer_closed = True
        self._buffer += chunk
        messages = []
        while len(self._buffer) >= _HEADER.size:
            kind, index, length = _HEADER.unpack_from(self._buffer)
            if kind not in _KIND_NAMES or length > _MAX_PAYLOAD_BYTES:
                raise OSError(f"malformed control message from {self.peer} (kind {kind})")
            if len(self._buffer) < _HEADER.size + length:
                break
            payload = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
            del self._buffer[: _HEADER.size + length]
            messages.append((kind, index, payload))
        return messages

    def close(self) -> None:
        self.sock.close()


class _MooncakeEndpoint:
    """What both sides share: the engine, the control channels, waiting on them, aborting."""

    spec: TransportSpec
    name: str

    def _init_endpoint(self) -> None:
        self._mooncake: MooncakeEngine | None = None
        self._owns_engine = False
        self._store: Store | None = None
        self._hosts_store = False
        self._channels: dict[int, _Channel] = {}  # peer rank -> channel
        self._selector: selectors.BaseSelector | None = selectors.DefaultSelector()

    def _add_channel(self, rank: int, channel: _Channel) -> None:
        assert self._selector is not None
        self._channels[rank] = channel
        self._selector.register(channel.sock, selectors.EVENT_READ, channel)

    @abc.abstractmethod
    def _on_message(self, channel: _Channel, kind: int, index: int, payload: bytes) -> None:
        """A control message from a peer (the sink and the source read different ones)."""

    @abc.abstractmethod
    def _on_peer_closed(self, channel: _Channel) -> None:
        """A peer's control channel closed."""

    def _pump(
        self,
        waiting_on: Callable[[], list[str]],
        deadline: Deadline,
        waiting_for: str,
        index: int | None = None,
    ) -> None:
        """Handle control messages until `waiting_on()` (the peers we still wait for) is
        empty; a TransportError when a peer aborts, dies or misses the deadline."""
        assert self._selector is not None
        while missing := waiting_on():
            if deadline.expired():
                raise TransportError(
                    f"no {waiting_for} within {self.spec.timeout_s:g} s (peer hung or too slow)",
                    transfer_id=self.spec.transfer_id,
                    bucket_index=index,
                    peer=", ".join(missing),
                )
            for key, _ in self._selector.select(deadline.remaining_s()):
                channel: _Channel = key.data
                try:
                    messages = channel.read_available()
                except OSError as exc:
                    raise TransportError(
                        f"control connection failed ({exc})",
                        transfer_id=self.spec.transfer_id,
                        bucket_index=index,
                        peer=channel.peer,
                    ) from exc
                for kind, message_index, payload in messages:
                    if kind == ABORT:
                        reason = payload.decode(errors="replace")
                        raise TransportError(
                            f"aborted the transfer: {reason}",
                            transfer_id=self.spec.transfer_id,
                            bucket_index=index,
                            peer=channel.peer,
                            root_cause=reason,
                        )
                    self._on_message(channel, kind, message_index, payload)
                if channel.peer_closed:
                    self._selector.unregister(channel.sock)
                    self._on_peer_closed(channel)

    def _send_to(
        self, rank: int, kind: int, index: int = 0, payload: bytes = b"", bucket: int | None = None
    ) -> None:
        channel = self._channels[rank]
        try:
            channel.send(kind, index, payload, timeout_s=self.spec.timeout_s)
        except OSError as exc:
            raise TransportError(
                f"cannot send {_KIND_NAMES[kind]} on the control connection ({exc})",
                transfer_id=self.spec.transfer_id,
                bucket_index=bucket,
                peer=channel.peer,
            ) from exc

    def _abort_peers(self, reason: str) -> None:
        """Best effort: ABORT to every connected peer and under the store's abort key."""
        payload = reason.encode()[:_MAX_PAYLOAD_BYTES]
        for channel in self._channels.values():
            with contextlib.suppress(OSError):  # that peer is gone already
                channel.send(ABORT, 0, payload, timeout_s=_SEND_TIMEOUT_FOR_ABORT_S)
        if self._store is not None:
            try:
                self._store.set_timeout(_STORE_TIMEOUT_FOR_ABORT)
                if not self._store.check([ABORT_KEY]):
                    self._store.set(ABORT_KEY, reason)
            except RuntimeError:
                return  # the store's host (sender 0) is gone
            if self._hosts_store and not self._channels:
                self._linger_for_readers()

    def _linger_for_readers(self) -> None:
        """Set-up failed on the store's host, before any control connection: the peers waiting
        in the store learn the reason only from it. Keep it up until they have read it (the
        receivers that published, the other senders), for at most `_ABORT_LINGER`, so that
        they report the reason rather than "the store is gone"."""
        assert self._store is not None
        spec = self.spec
        readers = [sender_name(s) for s in range(1, spec.num_senders)] + [
            receiver_name(r)
            for r in range(spec.num_receivers)
            if _store_has(self._store, _receiver_key(r))
        ]
        if readers:
            with contextlib.suppress(RuntimeError):  # not all of them read it in time
                self._store.wait([abort_seen_key(ABORT_KEY, who) for who in readers], _ABORT_LINGER)

    def _published_abort(self) -> str | None:
        """The reason a peer published under the abort key, if any."""
        assert self._store is not None
        try:
            if self._store.check([ABORT_KEY]):
                reason = self._store.get(ABORT_KEY).decode()
                acknowledge_abort(self._store, ABORT_KEY, self.name)
                return reason
        except RuntimeError as exc:
            raise TransportError(
                f"the rendezvous store is gone ({exc})",
                transfer_id=self.spec.transfer_id,
                peer=f"{sender_name(0)} (rendezvous host)",
            ) from exc
        return None

    @classmethod
    def kept_resources(cls, spec: TransportSpec) -> dict[str, Any]:
        """One engine for the process (destroying one costs about a second)."""
        engine = MooncakeEngine(
            local_address_towards(spec.rendezvous_address[0]),
            protocol=spec.mooncake_protocol,
            device_name=spec.mooncake_device_name,
        )
        return {"engine": engine}

    def _use_engine(self, engine: MooncakeEngine | None) -> MooncakeEngine:
        """The caller's engine (reserved for this transfer), or a new one of our own."""
        spec = self.spec
        if spec.device != "cpu":
            raise self._transport_error(
                "the mooncake transport moves host memory only: use device='cpu' (copy the "
                "buckets to host memory) or the torch_distributed transport"
            )
        if engine is None:
            host = local_address_towards(spec.rendezvous_address[0])
            try:
                engine = MooncakeEngine(
                    host, protocol=spec.mooncake_protocol, device_name=spec.mooncake_device_name
                )
            except RuntimeError as exc:
                raise self._transport_error(str(exc)) from exc
            self._owns_engine = True
        elif engine.in_use_by is not None:
            raise self._transport_error(
                f"the Mooncake engine passed in is in use by {engine.in_use_by}: one transfer at "
                "a time per engine"
            )
        engine.in_use_by = f"{self.name} of transfer {spec.transfer_id!r}"
        self._mooncake = engine
        return engine

    def _transport_error(self, reason: str) -> TransportError:
        return TransportError(reason, transfer_id=self.spec.transfer_id, peer=self.name)

    def _release(self, *memory: Any) -> None:
        """Close the control connections (which tells the peers at once) and leave `memory`
        that the engine may still touch with the engine. Idempotent."""
        for channel in self._channels.values():
            channel.close()
        self._channels = {}
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        self._store = None
        if self._mooncake is not None:
            self._mooncake.keep_until_closed(memory)

    def _dispose(self) -> None:
        """Hand the engine back to its owner, or stop our own (about a second)."""
        engine, self._mooncake = self._mooncake, None
        if engine is None:
            return
        engine.in_use_by = None
        if self._owns_engine:
            engine.close()


class MooncakeSink(_MooncakeEndpoint, BucketSink):
    """Sender `sender_rank`: writes its buckets into every receiver's slots."""

    def __init__(
        self, spec: TransportSpec, sender_rank: int, *, engine: MooncakeEngine | None = None
    ) -> None:
        BucketSink.__init__(self, spec, sender_rank)
        self._init_endpoint()
        self._receivers: dict[int, dict[str, Any]] = {}  # rank -> session, slots
        self._granted: dict[int, set[int]] = {r: set() for r in range(spec.num_receivers)}
        self._done: set[int] = set()
        self._in_flight: list[torch.Tensor] = []  # sources of abandoned writes, kept alive
        try:
            self._connect(engine)
        except BaseException as exc:
            self._fail_set_up(exc)
            raise

    def _connect(self, engine: MooncakeEngine | None) -> None:
        spec = self.spec
        self._use_engine(engine)
        self._hosts_store = self.sender_rank == 0
        self._store = open_rendezvous_store(spec, host_it=self._hosts_store, who=self.name)
        # Every receiver first, then connect: a receiver that is waiting for its senders can
        # then tell a missing receiver (no key) from a missing sender.
        wait_for_keys(
            self._store,
            {_receiver_key(rank): receiver_name(rank) for rank in range(spec.num_receivers)},
            Deadline(spec.timeout_s),
            spec=spec,
            waiting_for="published address",
            abort_key=ABORT_KEY,
            who=self.name,
        )
        for rank in range(spec.num_receivers):
            key = _receiver_key(rank)
            info = json.loads(self._store.get(key))
            self._receivers[rank] = info
            control_host, _, control_port = info["control"].rpartition(":")
            peer = f"{receiver_name(rank)} ({info['control']})"
            try:
                sock = socket.create_connection(
                    (control_host, int(control_port)), timeout=spec.timeout_s
                )
            except OSError as exc:
                raise TransportError(
                    f"cannot connect to the control listener ({exc})",
                    transfer_id=spec.transfer_id,
                    peer=peer,
                ) from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._add_channel(rank, _Channel(sock, peer))
            self._send_to(rank, HELLO, self.sender_rank, spec.transfer_id.encode())

    def _on_message(self, channel: _Channel, kind: int, index: int, payload: bytes) -> None:
        rank = next(r for r, c in self._channels.items() if c is channel)
        if kind == FREE and self.spec.owner_of(index) == self.sender_rank:
            self._granted[rank].add(index)
        elif kind == DONE:
            self._done.add(rank)
        else:
            raise TransportError(
                f"unexpected {_KIND_NAMES[kind]} {index} on the control connection",
                transfer_id=self.spec.transfer_id,
                peer=channel.peer,
            )

    def _on_peer_closed(self, channel: _Channel) -> None:
        rank = next(r for r, c in self._channels.items() if c is channel)
        if rank not in self._done:
            raise TransportError(
                "closed its control connection before receiving every bucket (its process "
                "died or gave up)",
                transfer_id=self.spec.transfer_id,
                peer=channel.peer,
            )

    def _send(self, index: int, data: torch.Tensor) -> None:
        receivers = range(self.spec.num_receivers)
        self._pump(
            lambda: [self._channels[r].peer for r in receivers if index not in self._granted[r]],
            Deadline(self.spec.timeout_s),
            f"free slot for bucket {index}",
            index,
        )
        self._write_everywhere(index, data)
        for rank in receivers:
            self._granted[rank].discard(index)
            self._send_to(rank, READY, index, bucket=index)

    def _write_everywhere(self, index: int, data: torch.Tensor) -> None:
        """Write `data` into slot index % 2 of every receiver, the writes running together."""
        assert self._mooncake is not None
        engine, address, length = self._mooncake.engine, data.data_ptr(), data.numel()
        rc = engine.register_memory(address, length)
        if rc != 0:
            raise self._error(f"Mooncake could not register the bucket's memory (rc={rc})", index)
        batches: dict[int, int] = {}
        try:
            for rank, info in self._receivers.items():
                batch = engine.transfer_submit_write(
                    info["session"], address, info["slots"][index % 2], length
                )
                if batch in _FAILED_BATCH_IDS:
                    raise self._write_error(index, rank, "the write could not be submitted")
                batches[rank] = batch
            deadline = Deadline(self.spec.timeout_s)
            while batches:
                for rank, batch in list(batches.items()):
                    status = engine.transfer_check_status(batch)
                    if status == 1:
                        del batches[rank]
                    elif status < 0:
                        del batches[rank]  # failed: the engine freed the batch
                        raise self._write_error(index, rank, f"the write failed (status {status})")
                if batches and deadline.expired():
                    raise self._write_error(
                        index, next(iter(batches)), f"the write hung past {self.spec.timeout_s:g} s"
                    )
                if batches:
                    time.sleep(_POLL_SLEEP_S)
        finally:
            if batches:  # abandoned mid-flight: the engine may still read `data`
                self._in_flight.append(data)
            else:
                engine.unregister_memory(address)

    def _write_error(self, index: int, rank: int, reason: str) -> TransportError:
        info = self._receivers[rank]
        return TransportError(
            f"{reason}; session {info['session']}",
            transfer_id=self.spec.transfer_id,
            bucket_index=index,
            peer=self._channels[rank].peer,
        )

    def _finish(self) -> None:
        deadline = Deadline(self.spec.timeout_s)
        self._pump(
            lambda: [
                self._channels[r].peer
                for r in range(self.spec.num_receivers)
                if r not in self._done
            ],
            deadline,
            "confirmation that every bucket arrived",
        )
        assert self._store is not None
        if self.sender_rank != 0:
            self._store.set(_closed_key(self.sender_rank), "1")
        else:
            # Sender 0 hosts the store: keep it up until the other senders are through with it.
            wait_for_keys(
                self._store,
                {_closed_key(s): sender_name(s) for s in range(1, self.spec.num_senders)},
                deadline,
                spec=self.spec,
                waiting_for="close of the other senders",
                abort_key=ABORT_KEY,
            )
        self._release()

    def _abort(self, reason: str) -> None:
        self._abort_peers(reason)
        in_flight, self._in_flight = self._in_flight, []
        self._release(in_flight)


class MooncakeSource(_MooncakeEndpoint, BucketSource):
    """Receiver `receiver_rank`: two registered slots that the senders write into."""

    def __init__(
        self, spec: TransportSpec, receiver_rank: int, *, engine: MooncakeEngine | None = None
    ) -> None:
        BucketSource.__init__(self, spec, receiver_rank)
        self._init_endpoint()
        self._slots: list[torch.Tensor] = []
        self._ready: set[int] = set()
        try:
            self._set_up(engine)
        except BaseException as exc:
            self._fail_set_up(exc)
            raise

    def _set_up(self, engine: MooncakeEngine | None) -> None:
        spec = self.spec
        mooncake = self._use_engine(engine)
        try:
            self._slots = mooncake.receive_slots(spec.max_bucket_bytes)
        except RuntimeError as exc:
            raise self._transport_error(str(exc)) from exc
        host, session = mooncake.host, mooncake.session
        with socket.create_server((host, 0)) as listener:
            self._store = open_rendezvous_store(spec, host_it=False, who=self.name)
            control = f"{host}:{listener.getsockname()[1]}"
            info = {"session": session, "slots": [s.data_ptr() for s in self._slots]}
            self._store.set(
                _receiver_key(self.receiver_rank), json.dumps(info | {"control": control})
            )
            self._accept_senders(listener)
        for index in range(min(2, spec.num_buckets)):
            self._send_to(spec.owner_of(index), FREE, index, bucket=index)

    def _accept_senders(self, listener: socket.socket) -> None:
        """Take one HELLO connection from every sender; TransportError naming the senders that
        did not connect within the deadline, or at once when one aborted the transfer."""
        deadline = Deadline(self.spec.timeout_s)
        listener.settimeout(0.5)  # wake up now and then to look for a published abort
        while len(self._channels) < self.spec.num_senders:
            missing = [
                sender_name(s) for s in range(self.spec.num_senders) if s not in self._channels
            ]
            if deadline.expired():
                # Senders connect once every receiver has published: missing receivers first.
                assert self._store is not None
                receivers = range(self.spec.num_receivers)
                absent = [
                    receiver_name(r)
                    for r in receivers
                    if not _store_has(self._store, _receiver_key(r))
                ]
                raise TransportError(
                    f"never showed up within {self.spec.timeout_s:g} s",
                    transfer_id=self.spec.transfer_id,
                    peer=", ".join(absent or missing),
                )
            if (reason := self._published_abort()) is not None:
                raise TransportError(
                    f"a peer aborted: {reason}",
                    transfer_id=self.spec.transfer_id,
                    peer=self.name,
                    root_cause=reason,
                )
            try:
                sock, address = listener.accept()
            except TimeoutError:
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = _Channel(sock, f"a sender connecting from {address[0]}")
            rank = self._read_hello(channel, deadline)
            if rank is None or rank in self._channels:
                sock.close()  # a stray or duplicate connection: not part of this transfer
                continue
            channel.peer = f"{sender_name(rank)} ({address[0]})"
            self._add_channel(rank, channel)

    def _read_hello(self, channel: _Channel, deadline: Deadline) -> int | None:
        """The sender rank of a valid HELLO for this transfer, else None."""
        channel.sock.settimeout(max(deadline.remaining_s(), 0.001))
        try:
            while not (messages := channel.read_available()):
                if channel.peer_closed:
                    return None
        except OSError:
            return None
        kind, rank, payload = messages[0]
        valid = kind == HELLO and payload == self.spec.transfer_id.encode()
        return rank if valid and 0 <= rank < self.spec.num_senders else None

    def _on_message(self, channel: _Channel, kind: int, index: int, payload: bytes) -> None:
        rank = next(r for r, c in self._channels.items() if c is channel)
        if kind == READY and self.spec.owner_of(index) == rank:
            self._ready.add(index)
        else:
            raise TransportError(
                f"unexpected {_KIND_NAMES[kind]} {index} on the control connection",
                transfer_id=self.spec.transfer_id,
                peer=channel.peer,
            )

    def _on_peer_closed(self, channel: _Channel) -> None:
        rank = next(r for r, c in self._channels.items() if c is channel)
        owed = [
            i for i in self.spec.buckets_of(rank) if i >= self._next_index and i not in self._ready
        ]
        if owed:
            raise TransportError(
                f"closed its control connection before sending bucket {owed[0]} (its process "
                "died or gave up)",
                transfer_id=self.spec.transfer_id,
                bucket_index=owed[0],
                peer=channel.peer,
            )

    def _recv(self, index: int) -> torch.Tensor:
        spec = self.spec
        # The caller is done with bucket index - 1: its slot may take bucket index + 1.
        if index >= 1 and index + 1 < spec.num_buckets:
            self._send_to(spec.owner_of(index + 1), FREE, index + 1, bucket=index + 1)
        owner = spec.owner_of(index)
        self._pump(
            lambda: [] if index in self._ready else [self._channels[owner].peer],
            Deadline(spec.timeout_s),
            f"bucket {index}",
            index,
        )
        self._ready.discard(index)
        if index == spec.num_buckets - 1:
            for rank in range(spec.num_senders):
                self._send_to(rank, DONE, bucket=index)
        return self._slots[index % 2][: spec.bucket_sizes[index]]

    def _finish(self) -> None:
        self._slots = []  # the engine owns them
        self._release()

    def _abort(self, reason: str) -> None:
        self._abort_peers(reason)
        self._slots = []
        self._release()
