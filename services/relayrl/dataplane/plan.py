"""The bucket plan: how a stream of named tensors becomes fixed-size byte buckets and back.

Sending one network message per tensor lets latency dominate (a 7B model has ~300 tensors, many
of them tiny norms), so the sender flattens every tensor to bytes and packs them into buckets of
``bucket_size_bytes``; a tensor that does not fit in what is left of a bucket is split into
chunks over consecutive buckets. Each chunk is described by a :class:`Piece`, which carries
exactly the fields of the ``TensorMeta`` proto so that the control plane (gRPC) can announce a
bucket's contents while the data plane (broadcast, RDMA, gRPC stream) moves its raw bytes.

One plan agreed by both sides. :func:`plan_buckets` is a pure function of the tensor list and
the bucket size, so every trainer rank and every engine computes the same plan; they exchange
:func:`plan_digest` before the first byte moves and refuse to proceed on a mismatch, instead
of silently loading bytes into the wrong tensor.

Count-based flush (docs/weightsync.md#count-based-flush). Data-plane collectives (an NCCL/gloo
broadcast per bucket) only work when every participating rank issues the same sequence of calls.
A per-rank *byte* trigger ("flush when my local buffer holds 512 MiB") fires at different
moments on ranks that hold different amounts of data (pipeline stages, uneven expert shards, the
last rank's remainder), so rank 0 enters broadcast #k while rank 1 is still filling its buffer,
and the collective hangs forever. Flushing must be driven by a signal that is identical on every
rank: here, the bucket index of a plan that all ranks computed from the same input. The number
of buckets (and hence of collective calls) is a property of the agreed plan, never of local
state.

Double buffering (docs/weightsync.md#double-buffering). :class:`DoubleBufferedPacker` fills
bucket i+1 in a background thread while the caller sends bucket i, at the cost of exactly two
bucket-sized buffers.
"""

from __future__ import annotations

import hashlib
import json
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.proto.common.v1 import common_pb2

DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
"""Dtypes a plan can carry: the ``DType`` enum of common.proto, by their torch names."""

NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}

_DTYPE_TO_PROTO: dict[str, int] = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
    "float8_e4m3fn": common_pb2.DTYPE_FLOAT8_E4M3,
    "int32": common_pb2.DTYPE_INT32,
    "int64": common_pb2.DTYPE_INT64,
    "uint8": common_pb2.DTYPE_UINT8,
}
_PROTO_TO_DTYPE: dict[int, str] = {v: k for k, v in _DTYPE_TO_PROTO.items()}

QUANTIZATIONS: tuple[str, ...] = ("none", "fp8_per_tensor", "fp8_block_128")
_QUANT_TO_PROTO: dict[str, int] = {
    "none": common_pb2.QUANTIZATION_NONE,
    "fp8_per_tensor": common_pb2.QUANTIZATION_FP8_PER_TENSOR,
    "fp8_block_128": common_pb2.QUANTIZATION_FP8_BLOCK_128,
}
# proto3 leaves an unset enum at 0: a sender that did not say is sending unquantised values.
_PROTO_TO_QUANT: dict[int, str] = {
    **{v: k for k, v in _QUANT_TO_PROTO.items()},
    common_pb2.QUANTIZATION_UNSPECIFIED: "none",
}

TensorSource = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]
"""Where packing reads tensors from: a name -> tensor mapping, or a callable (lazy export)."""


class PlanMismatchError(ValueError):
    """The two sides computed different bucket plans; moving bytes would corrupt weights."""


class BucketOrderError(RuntimeError):
    """A bucket arrived out of plan order (or twice, or was never announced)."""


class BucketChecksumError(ValueError):
    """A bucket's bytes do not match the sha256 its sender computed."""


class IncompleteTransferError(RuntimeError):
    """The transfer ended with buckets or tensor chunks still missing."""


def _check_dtype_name(dtype: str) -> None:
    if dtype not in DTYPE_BY_NAME:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPE_BY_NAME)}")


def _check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class TensorSpec:
    """What a plan needs to know about one tensor: its name, shape and dtype (not its values).

    ``quantization`` and ``scale_name`` are copied into every :class:`Piece` of the tensor so
    the receiver knows which tensor holds its FP8 scales (see :mod:`relayrl.dataplane.quant`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    quantization: str = "none"
    scale_name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
        _check_dtype_name(self.dtype)
        _check_quantization(self.quantization)

    @property
    def itemsize_bytes(self) -> int:
        return DTYPE_BY_NAME[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.itemsize_bytes

    @classmethod
    def from_tensor(
        cls, name: str, t: torch.Tensor, *, quantization: str = "none", scale_name: str = ""
    ) -> TensorSpec:
        """The spec of an existing tensor; raises ValueError for a dtype a plan cannot carry."""
        if t.dtype not in NAME_BY_DTYPE:
            raise ValueError(
                f"tensor {name!r} has dtype {t.dtype}, which weight-sync cannot carry; "
                f"cast it to one of {sorted(DTYPE_BY_NAME)}"
            )
        return cls(name, tuple(t.shape), NAME_BY_DTYPE[t.dtype], quantization, scale_name)


@dataclass(frozen=True)
class Piece:
    """One chunk of one tensor inside one bucket: the fields of the ``TensorMeta`` proto.

    A tensor that fits in its bucket has one piece with ``chunk_offset_bytes == 0`` and
    ``size_bytes == total_bytes``; a split tensor has one piece per bucket it spans.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket_index: int
    offset_bytes: int
    size_bytes: int
    chunk_offset_bytes: int
    total_bytes: int
    quantization: str = "none"
    scale_name: str = ""

    @property
    def is_first(self) -> bool:
        return self.chunk_offset_bytes == 0

    @property
    def is_last(self) -> bool:
        return self.chunk_offset_bytes + self.size_bytes == self.total_bytes

    def to_proto(self) -> common_pb2.TensorMeta:
        return common_pb2.TensorMeta(
            name=self.name,
            shape=list(self.shape),
            dtype=_DTYPE_TO_PROTO[self.dtype],
            quantization=_QUANT_TO_PROTO[self.quantization],
            scale_name=self.scale_name,
            bucket_index=self.bucket_index,
            offset_bytes=self.offset_bytes,
            size_bytes=self.size_bytes,
            chunk_offset_bytes=self.chunk_offset_bytes,
            total_bytes=self.total_bytes,
        )

    @classmethod
    def from_proto(cls, meta: common_pb2.TensorMeta) -> Piece:
        """Decode a ``TensorMeta``; raises ValueError for an unset or unknown dtype."""
        if meta.dtype not in _PROTO_TO_DTYPE:
            raise ValueError(f"TensorMeta {meta.name!r}: unsupported dtype enum {meta.dtype}")
        if meta.quantization not in _PROTO_TO_QUANT:
            raise ValueError(f"TensorMeta {meta.name!r}: unknown quantization {meta.quantization}")
        return cls(
            name=meta.name,
            shape=tuple(int(d) for d in meta.shape),
            dtype=_PROTO_TO_DTYPE[meta.dtype],
            bucket_index=meta.bucket_index,
            offset_bytes=meta.offset_bytes,
            size_bytes=meta.size_bytes,
            chunk_offset_bytes=meta.chunk_offset_bytes,
            total_bytes=meta.total_bytes,
            quantization=_PROTO_TO_QUANT[meta.quantization],
            scale_name=meta.scale_name,
        )


@dataclass(frozen=True)
class BucketLayout:
    """One bucket of a plan: ``size_bytes`` is what goes on the wire (pieces plus padding)."""

    index: int
    size_bytes: int
    pieces: tuple[Piece, ...]


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def plan_buckets(
    tensors: Sequence[TensorSpec], bucket_size_bytes: int, *, alignment: int = 64
) -> list[BucketLayout]:
    """Lay ``tensors`` out, in input order, into buckets of at most ``bucket_size_bytes``.

    Every piece starts at an ``alignment``-byte offset of its bucket (so a receiver may view a
    chunk in place as its dtype, and DMA engines see aligned addresses). A tensor that does not
    fit in what is left of the current bucket is split: its first chunk fills the bucket and
    the rest continues at offset 0 of the next ones, so every bucket except the last is full.
    A 0-element tensor becomes a 0-byte piece in the current bucket. Deterministic: the same
    input gives the same plan on every rank.
    """
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    if bucket_size_bytes < alignment:
        raise ValueError(
            f"bucket_size_bytes={bucket_size_bytes} is smaller than alignment={alignment}; "
            "use a bucket of at least one alignment unit (typically tens of MiB)"
        )
    if bucket_size_bytes % alignment:
        raise ValueError(
            f"bucket_size_bytes={bucket_size_bytes} must be a multiple of alignment={alignment} "
            "so that chunks of a split tensor start on aligned boundaries"
        )
    seen: set[str] = set()
    for spec in tensors:
        if not spec.name:
            raise ValueError("tensor with an empty name: every tensor needs its HF name")
        if spec.name in seen:
            raise ValueError(f"duplicate tensor name {spec.name!r} in the plan input")
        seen.add(spec.name)

    buckets: list[list[Piece]] = []
    offset_bytes = 0  # first free byte of the current bucket (buckets[-1])

    def piece(spec: TensorSpec, at: int, size: int, chunk_at: int) -> Piece:
        return Piece(
            name=spec.name,
            shape=spec.shape,
            dtype=spec.dtype,
            bucket_index=len(buckets) - 1,
            offset_bytes=at,
            size_bytes=size,
            chunk_offset_bytes=chunk_at,
            total_bytes=spec.nbytes,
            quantization=spec.quantization,
            scale_name=spec.scale_name,
        )

    for spec in tensors:
        total_bytes = spec.nbytes
        if total_bytes == 0:
            if not buckets:
                buckets.append([])
            at = min(_align_up(offset_bytes, alignment), bucket_size_bytes)
            buckets[-1].append(piece(spec, at, 0, 0))
            offset_bytes = at
            continue
        chunk_at = 0
        while chunk_at < total_bytes:
            offset_bytes = _align_up(offset_bytes, alignment)
            if not buckets or offset_bytes >= bucket_size_bytes:
                buckets.append([])
                offset_bytes = 0
            size = min(bucket_size_bytes - offset_bytes, total_bytes - chunk_at)
            buckets[-1].append(piece(spec, offset_bytes, size, chunk_at))
            offset_bytes += size
            chunk_at += size

    return [
        BucketLayout(
            index=i,
            size_bytes=max((p.offset_bytes + p.size_bytes for p in pieces), default=0),
            pieces=tuple(pieces),
        )
        for i, pieces in enumerate(buckets)
    ]


def layouts_from_pieces(pieces: Sequence[Piece]) -> list[BucketLayout]:
    """Rebuild a plan from the pieces announced over the control plane (receiver side).

    Raises ValueError when the pieces do not describe buckets 0..n-1 in order.
    """
    by_bucket: dict[int, list[Piece]] = {}
    for p in pieces:
        by_bucket.setdefault(p.bucket_index, []).append(p)
    if sorted(by_bucket) != list(range(len(by_bucket))):
        raise ValueError(f"pieces name buckets {sorted(by_bucket)}, expected 0..n-1 with no gaps")
    return [
        BucketLayout(
            index=i,
            size_bytes=max(p.offset_bytes + p.size_bytes for p in by_bucket[i]),
            pieces=tuple(by_bucket[i]),
        )
        for i in range(len(by_bucket))
    ]


def layouts_from_plan(plan: Any) -> list[BucketLayout]:
    """The layouts of a `BucketPlan` proto as weight-sync announces it (sender and receiver)."""
    return [
        BucketLayout(
            index=b.index,
            size_bytes=b.size_bytes,
            pieces=tuple(Piece.from_proto(t) for t in b.tensors),
        )
        for b in plan.buckets
    ]


def plan_digest(plan: Sequence[BucketLayout]) -> str:
    """sha256 of the canonical plan; equal digests mean both sides will agree on every byte."""
    canonical: list[Any] = [
        [
            layout.index,
            layout.size_bytes,
            [
                [
                    p.name,
                    list(p.shape),
                    p.dtype,
                    p.bucket_index,
                    p.offset_bytes,
                    p.size_bytes,
                    p.chunk_offset_bytes,
                    p.total_bytes,
                    p.quantization,
                    p.scale_name,
                ]
                for p in layout.pieces
            ],
        ]
        for layout in plan
    ]
    text = json.dumps({"version": 1, "buckets": canonical}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def verify_plan_digest(plan: Sequence[BucketLayout], expected_digest: str) -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` has the peer's digest."""
    actual = plan_digest(plan)
    if actual != expected_digest:
        raise PlanMismatchError(
            f"bucket plan digest {actual[:16]}… differs from the peer's {expected_digest[:16]}…; "
            "the two sides disagree on tensor names, shapes, dtypes or bucket size"
        )


def as_byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous, else a copy)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _as_uint8(data: torch.Tensor | bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return as_byte_view(data)
    if len(memoryview(data).cast("B")) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers (bytes); we only ever read from this view.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def bucket_sha256(data: torch.Tensor | bytes | bytearray | memoryview) -> str:
    """Hex sha256 of a bucket's bytes (any tensor is hashed as its raw bytes)."""
    if isinstance(data, torch.Tensor):
        return hashlib.sha256(as_byte_view(data).cpu().numpy()).hexdigest()
    return hashlib.sha256(data).hexdigest()


def _lookup(source: TensorSource, name: str) -> torch.Tensor:
    if isinstance(source, Mapping):
        if name not in source:
            raise KeyError(f"tensor {name!r} is in the bucket plan but not among the tensors")
        return source[name]
    return source(name)


def pack_bucket(layout: BucketLayout, tensors: TensorSource, out: torch.Tensor) -> torch.Tensor:
    """Copy every piece of ``layout`` into ``out`` and return the view ``out[:size_bytes]``.

    Padding between pieces is zeroed so that a bucket's sha256 does not depend on whatever a
    reused buffer held before. A tensor split over several buckets is made contiguous once per
    bucket; pass contiguous tensors to avoid the repeated copy.
    """
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("out must be a contiguous 1-D uint8 tensor")
    if out.numel() < layout.size_bytes:
        raise ValueError(
            f"bucket {layout.index} needs {layout.size_bytes} bytes, out holds {out.numel()}"
        )
    cursor_bytes = 0
    for p in layout.pieces:
        t = _lookup(tensors, p.name)
        dtype = DTYPE_BY_NAME[p.dtype]
        if t.dtype != dtype or tuple(t.shape) != p.shape:
            raise ValueError(
                f"tensor {p.name!r} is {t.dtype} {tuple(t.shape)} but the plan says "
                f"{dtype} {p.shape}; rebuild the plan from the tensors being sent"
            )
        if p.offset_bytes > cursor_bytes:
            out[cursor_bytes : p.offset_bytes].zero_()
        src = as_byte_view(t)[p.chunk_offset_bytes : p.chunk_offset_bytes + p.size_bytes]
        out[p.offset_bytes : p.offset_bytes + p.size_bytes].copy_(src)
        cursor_bytes = max(cursor_bytes, p.offset_bytes + p.size_bytes)
    return out[: layout.size_bytes]


def _bytes_to_tensor(buf: torch.Tensor, p: Piece) -> torch.Tensor:
    dtype = DTYPE_BY_NAME[p.dtype]
    return (buf if dtype == torch.uint8 else buf.view(dtype)).reshape(p.shape)


class BucketAssembler:
    """Receiver side: turns buckets, fed in plan order, back into named tensors.

    Memory: the plan never interleaves tensors, so at most one tensor is partially assembled
    at a time; the assembler holds that tensor's buffer and nothing else (the caller owns the
    bucket). Every returned tensor owns its storage, so the bucket buffer may be reused as soon
    as :meth:`feed` returns.
    """

    def __init__(self, plan: Sequence[BucketLayout]) -> None:
        self._plan = list(plan)
        self._next_index = 0
        self._partial: tuple[Piece, torch.Tensor] | None = None  # (first piece, byte buffer)
        self._filled_bytes = 0

    @property
    def num_buckets_received(self) -> int:
        return self._next_index

    def feed(
        self,
        index: int,
        data: torch.Tensor | bytes | bytearray | memoryview,
        *,
        expected_sha256: str | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Consume bucket ``index``; return the tensors it completes, in plan order.

        Raises :class:`BucketOrderError` unless ``index`` is the next bucket of the plan, and
        :class:`BucketChecksumError` when ``expected_sha256`` is given and does not match.
        """
        return list(self.stream(index, data, expected_sha256=expected_sha256))

    def stream(
        self,
        index: int,
        data: torch.Tensor | bytes | bytearray | memoryview,
        *,
        expected_sha256: str | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`feed`, one tensor at a time: a consumer that drops each tensor before asking
        for the next holds one of them, not every tensor of the bucket. The bucket counts as
        received once the iterator is exhausted."""
        if index != self._next_index:
            raise BucketOrderError(
                f"received bucket {index}, expected bucket {self._next_index} "
                f"of {len(self._plan)}: buckets must arrive in plan order"
            )
        layout = self._plan[index]
        buf = _as_uint8(data)
        if buf.numel() < layout.size_bytes:
            raise ValueError(
                f"bucket {index} carries {buf.numel()} bytes, the plan says {layout.size_bytes}"
            )
        buf = buf[: layout.size_bytes]
        if expected_sha256 is not None:
            actual = bucket_sha256(buf)
            if actual != expected_sha256:
                raise BucketChecksumError(
                    f"bucket {index}: sha256 {actual[:16]}… != sender's {expected_sha256[:16]}…"
                )
        for p in layout.pieces:
            chunk = buf[p.offset_bytes : p.offset_bytes + p.size_bytes]
            finished = self._take(p, chunk)
            if finished is not None:
                yield finished
        self._next_index += 1

    def _take(self, p: Piece, chunk: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if p.is_first and self._partial is not None:
            # A plan rebuilt from the wire could interleave tensors; plan_buckets never does.
            raise BucketOrderError(
                f"{p.name!r} starts while {self._partial[0].name!r} is still incomplete"
            )
        if p.is_first and p.is_last:
            return p.name, _bytes_to_tensor(chunk.clone(), p)
        if p.is_first:
            self._partial = (p, torch.empty(p.total_bytes, dtype=torch.uint8, device=chunk.device))
            self._filled_bytes = 0
        if self._partial is None or self._partial[0].name != p.name:
            raise BucketOrderError(f"chunk of {p.name!r} arrived before its first chunk")
        if p.chunk_offset_bytes != self._filled_bytes:
            raise BucketOrderError(
                f"chunk of {p.name!r} at byte {p.chunk_offset_bytes}, expected {self._filled_bytes}"
            )
        first, tensor_bytes = self._partial
        tensor_bytes[p.chunk_offset_bytes : p.chunk_offset_bytes + p.size_bytes].copy_(chunk)
        self._filled_bytes += p.size_bytes
        if not p.is_last:
            return None
        self._partial = None
        return p.name, _bytes_to_tensor(tensor_bytes, first)

    def finish(self) -> None:
        """Raise :class:`IncompleteTransferError` unless every bucket and tensor arrived."""
        if self._next_index != len(self._plan) or self._partial is not None:
            partial = f"; {self._partial[0].name!r} is incomplete" if self._partial else ""
            raise IncompleteTransferError(
                f"received {self._next_index} of {len(self._plan)} buckets{partial}"
            )


class DoubleBufferedPacker:
    """Sender side: iterate ``(index, view, sha256)``, packing the next bucket meanwhile.

    Two ``bucket_size_bytes`` uint8 buffers alternate: bucket i lives in buffer ``i % 2``.
    Packing bucket i+2 reuses bucket i's buffer, so it starts only when the caller calls
    :meth:`release(i) <release>` — after the transport has finished reading bucket i (for an
    async broadcast: after waiting on its handle). The contract:

        for index, view, sha256 in packer:
            send(view, sha256)   # may be async for bucket i while i+1 is packed
            packer.release(index)

    The caller may hold bucket i while asking for bucket i+1, but must release bucket i before
    asking for bucket i+2; asking earlier raises :class:`BucketOrderError` instead of handing
    out a buffer that is still being overwritten. A view must not be read after its release.
    Packing and hashing run in one background thread; errors surface from ``__next__``.
    ``index`` is the bucket's position in ``plan`` (equal to ``layout.index`` for a whole plan;
    a rank that sends a subset of the buckets maps it back through its own list).
    """

    def __init__(
        self,
        plan: Sequence[BucketLayout],
        tensors: TensorSource,
        bucket_size_bytes: int,
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        compute_sha256: bool = True,
    ) -> None:
        self._plan = list(plan)
        largest_bytes = max((b.size_bytes for b in self._plan), default=0)
        if largest_bytes > bucket_size_bytes:
            raise ValueError(
                f"plan has a {largest_bytes}-byte bucket, buffers hold {bucket_size_bytes}; "
                "plan with the same bucket size"
            )
        self._tensors = tensors
        self._compute_sha256 = compute_sha256
        self._buffers = [
            torch.empty(bucket_size_bytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
            for _ in range(2)
        ]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-pack")
        self._lock = threading.Lock()
        self._futures: dict[int, Future[tuple[torch.Tensor, str]]] = {}
        self._handed_out: set[int] = set()
        self._next_index = 0
        for i in range(min(2, len(self._plan))):
            self._submit(i)

    def _submit(self, index: int) -> None:
        self._futures[index] = self._executor.submit(self._pack, index)

    def _pack(self, index: int) -> tuple[torch.Tensor, str]:
        view = pack_bucket(self._plan[index], self._tensors, self._buffers[index % 2])
        return view, bucket_sha256(view) if self._compute_sha256 else ""

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, str]]:
        return self

    def __next__(self) -> tuple[int, torch.Tensor, str]:
        with self._lock:
            index = self._next_index
            if index >= len(self._plan):
                self.close()
                raise StopIteration
            future = self._futures.pop(index, None)
            if future is None:
                raise BucketOrderError(
                    f"asked for bucket {index} before releasing bucket {index - 2}, whose "
                    "buffer it reuses; call release() once the transport is done with a bucket"
                )
            self._next_index += 1
        view, sha256 = future.result()
        with self._lock:
            self._handed_out.add(index)
        return index, view, sha256

    def release(self, index: int) -> None:
        """Give bucket ``index``'s buffer back; packing of bucket ``index + 2`` starts now."""
        with self._lock:
            if index not in self._handed_out:
                raise BucketOrderError(f"release({index}): bucket {index} is not held")
            self._handed_out.remove(index)
            if index + 2 < len(self._plan):
                self._submit(index + 2)

    def close(self) -> None:
        """Stop the packing thread; pending packs are cancelled."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> DoubleBufferedPacker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
