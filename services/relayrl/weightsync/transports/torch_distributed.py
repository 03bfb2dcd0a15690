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

Deadlines and failures. Every group is built with `timeout_s` as its operation timeout, and
every wait polls the broadcast against its own deadline of `timeout_s`, so a peer that never
posts a broadcast (absent, hung) fails it within `timeout_s`. A peer whose process dies closes
its sockets and fails its partners at once. A side that fails while its process lives on
records its reason under the key `abort` of the rendezvous store (which the waits check every
0.25 s and quote) and destroys its groups, which closes their connections: gloo's `abort()` and
`shutdown()` leave them open (measured), only the destructor closes them, and it waits for the
group's pending broadcasts, so it runs on a daemon thread.

CUDA: with `spec.device == "cuda"` the groups are NCCL and the buffers live on the current CUDA
device. That path is UNTESTED here (no GPU; NCCL also refuses two ranks on one GPU).
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from relayrl.weightsync.transports.base import (
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
_ABORT_CHECK_S = 0.25
_FIRST_POLL_SLEEP_S = 0.00005
_MAX_POLL_SLEEP_S = 0.001


def _present_key(name: str) -> str:
    return f"present/{name.replace(' ', '')}"


def _done_key(receiver_rank: int) -> str:
    return f"done/receiver{receiver_rank}"


def _closed_key(sender_rank: int) -> str:
    return f"closed/sender{sender_rank}"


def _build_group(
    store: Store, spec: TransportSpec, group_of: int, group_rank: int, who: str
) -> ProcessGroup:
    """The group of sender `group_of` (sender = group rank 0, receiver r = 1 + r); blocks until
    every member has joined, at most `timeout_s`."""
    import torch.distributed as dist

    group_store = dist.PrefixStore(f"group{group_of}/", store)
    size = 1 + spec.num_receivers
    timeout = timedelta(seconds=spec.timeout_s)
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
            f"{spec.timeout_s:g} s{absent} ({exc})",
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


class _StoreEndpoint:
    """What both sides share: waiting for a broadcast while watching for a published abort,
    publishing their own abort reason."""

    spec: TransportSpec
    name: str
    _store: Store | None
    _store_reachable: bool

    def _wait(self, work: Work) -> str:
        """Wait until `work` is done, at most `timeout_s`; "" when it succeeded, else why not.

        Polls instead of `work.wait()` so that an abort a peer published (a peer whose process
        lives on after giving up keeps its gloo connections open) ends the wait at once.
        Returns the error as text rather than raising it so that no traceback keeps `work`,
        and with it the group's connections, alive after an abort."""
        deadline = Deadline(self.spec.timeout_s)
        sleep_s, next_abort_check = _FIRST_POLL_SLEEP_S, time.monotonic() + _ABORT_CHECK_S
        while not work.is_completed():
            if time.monotonic() >= next_abort_check:
                if reason := self._published_abort():
                    return f"a peer aborted: {reason}"
                next_abort_check = time.monotonic() + _ABORT_CHECK_S
            if deadline.expired():
                return f"not done within {self.spec.timeout_s:g} s"
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _MAX_POLL_SLEEP_S)
        try:
            work.wait()  # raises the broadcast's own error, if it failed
        except RuntimeError as exc:
            return _short_gloo_error(str(exc))
        return ""

    def _published_abort(self) -> str:
        """The reason a peer published under the abort key, or "" (also when the store's host
        is gone: then the closed connections tell the story)."""
        if self._store is None or not self._store_reachable:
            return ""
        try:
            if self._store.check([ABORT_KEY]):
                return self._store.get(ABORT_KEY).decode()
        except RuntimeError:
            self._store_reachable = False  # sender 0 is gone; do not ask again
        return ""

    def _publish_abort(self, reason: str) -> None:
        if self._store is None or not self._store_reachable:
            return
        try:
            self._store.set_timeout(_STORE_TIMEOUT_FOR_ABORT)
            if not self._store.check([ABORT_KEY]):
                self._store.set(ABORT_KEY, reason)
        except RuntimeError:
            self._store_reachable = False  # peers learn from their closed connections

    def _abort_note(self, error: str) -> str:
        if error.startswith("a peer aborted"):
            return ""
        reason = self._published_abort()
        return f"; a peer aborted: {reason}" if reason else ""


class TorchDistributedSink(_StoreEndpoint, BucketSink):
    """Sender `sender_rank`: hosts the rendezvous store if it is sender 0, builds its group."""

    def __init__(self, spec: TransportSpec, sender_rank: int) -> None:
        super().__init__(spec, sender_rank)
        self._store, self._store_reachable = None, True
        self._group: ProcessGroup | None = None
        try:
            self._store = open_rendezvous_store(spec, host_it=sender_rank == 0, who=self.name)
            self._store.set(_present_key(self.name), "1")
            self._group = _build_group(self._store, spec, sender_rank, 0, self.name)
        except BaseException as exc:
            self._fail_set_up(exc)
            raise

    def _send(self, index: int, data: torch.Tensor) -> None:
        assert self._group is not None
        error = self._wait(_broadcast(self._group, data, self.spec.timeout_s))
        if error:
            raise TransportError(
                f"broadcast to the receivers failed ({error}){self._abort_note(error)}",
                transfer_id=self.spec.transfer_id,
                bucket_index=index,
                peer=f"{self.name} -> receivers",
            )

    def _finish(self) -> None:
        assert self._store is not None
        deadline = Deadline(self.spec.timeout_s)
        done = {_done_key(r): receiver_name(r) for r in range(self.spec.num_receivers)}
        wait_for_keys(
            self._store,
            done,
            deadline,
            spec=self.spec,
            waiting_for="confirmation that every bucket arrived",
            abort_key=ABORT_KEY,
        )
        if self.sender_rank != 0:
            self._store.set(_closed_key(self.sender_rank), "1")
        else:
            # Sender 0 hosts the store: keep it up until the other senders are through with it.
            others = {_closed_key(s): sender_name(s) for s in range(1, self.spec.num_senders)}
            wait_for_keys(
                self._store,
                others,
                deadline,
                spec=self.spec,
                waiting_for="close of the other senders",
                abort_key=ABORT_KEY,
            )
        self._group = None
        self._store = None

    def _abort(self, reason: str) -> None:
        self._publish_abort(reason)
        # Only destroying a gloo group closes its connections (abort() and shutdown() leave
        # them open, so peers would wait for their deadline); its destructor first waits for
        # the group's pending broadcasts, which end only once the peers give up too.
        objects: list[object] = [self._group]
        self._group = None  # before the thread starts: it must hold the last reference
        _drop_in_background(objects)
        self._store = None


class TorchDistributedSource(_StoreEndpoint, BucketSource):
    """Receiver `receiver_rank`: joins every sender's group, double-buffers the buckets."""

    def __init__(self, spec: TransportSpec, receiver_rank: int) -> None:
        super().__init__(spec, receiver_rank)
        self._store, self._store_reachable = None, True
        self._groups: list[ProcessGroup] = []
        self._pending: dict[int, Work] = {}
        self._buffers: list[torch.Tensor] = []
        try:
            self._store = open_rendezvous_store(spec, host_it=False, who=self.name)
            self._store.set(_present_key(self.name), "1")
            self._groups = [
                _build_group(self._store, spec, s, 1 + receiver_rank, self.name)
                for s in range(spec.num_senders)
            ]
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

    def _view(self, index: int) -> torch.Tensor:
        return self._buffers[index % 2][: self.spec.bucket_sizes[index]]

    def _post(self, index: int) -> None:
        group = self._groups[self.spec.owner_of(index)]
        self._pending[index] = _broadcast(group, self._view(index), self.spec.timeout_s)

    def _recv(self, index: int) -> torch.Tensor:
        # The caller is done with bucket index - 1: its buffer takes bucket index + 1.
        if index >= 1 and index + 1 < self.spec.num_buckets:
            self._post(index + 1)
        owner = self.spec.owner_of(index)
        error = self._wait(self._pending.pop(index))
        if error:
            raise TransportError(
                f"broadcast from {sender_name(owner)} failed ({error}){self._abort_note(error)}",
                transfer_id=self.spec.transfer_id,
                bucket_index=index,
                peer=f"{sender_name(owner)} -> {self.name}",
            )
        if index == self.spec.num_buckets - 1:
            assert self._store is not None
            self._store.set(_done_key(self.receiver_rank), "1")
        return self._view(index)

    def _finish(self) -> None:
        self._release()

    def _abort(self, reason: str) -> None:
        self._publish_abort(reason)
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
