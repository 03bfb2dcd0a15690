"""Optional delta mode: send only the elements that changed since the last sync
(docs/weightsync.md#delta-mode).

Between two RL steps most bf16 weights do not change *bitwise* (an update smaller than half a
bf16 ulp rounds away), so the sender keeps, per tensor, a host-memory snapshot of what it last
sent and ships ``(flat position, new value)`` pairs for the elements whose bits differ. The
first transfer of a tensor (the seed) is full, and so is any transfer where the sparse payload
would not be smaller (8 bytes of position per changed element make the break-even point
``itemsize / (8 + itemsize)`` of the elements: 20% for bf16).

Comparison is bitwise, not ``!=``: ``-0.0 == 0.0`` would drop a sign change and ``NaN != NaN``
would resend NaNs forever; either way the receiver's tensor would drift from the sender's.
Every payload carries the sha256 of the *full new tensor*, so a receiver whose base has drifted
(a missed update, a restarted engine) detects it instead of computing with a silently different
policy; the fix is a full re-seed (:meth:`DeltaEncoder.reset`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

from relayrl.transfer.plan import as_byte_view

_POSITION_BYTES = torch.empty((), dtype=torch.int64).element_size()


class DeltaChecksumError(ValueError):
    """The tensor rebuilt from a delta differs from the sender's; the base was not the one the
    sender diffed against. Re-seed with a full transfer."""


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of a tensor's raw bytes (row-major, native byte order)."""
    return hashlib.sha256(as_byte_view(t).cpu().numpy()).hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` (flattened) as integers of the same width, for bitwise comparison."""
    flat = t.reshape(-1)
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        flat.element_size()
    ]
    return flat if flat.dtype == int_dtype else flat.view(int_dtype)


@dataclass(frozen=True)
class DeltaPayload:
    """What goes on the wire for one tensor in delta mode.

    ``kind == "full"``: ``values`` is the whole tensor (``positions`` is None).
    ``kind == "sparse"``: ``values[i]`` is the new value at flat index ``positions[i]``.
    """

    name: str
    kind: Literal["full", "sparse"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor | None
    values: torch.Tensor
    checksum: str

    @property
    def nbytes(self) -> int:
        """Bytes this payload moves (positions plus values; the checksum is negligible)."""
        positions_bytes = 0 if self.positions is None else self.positions.numel() * _POSITION_BYTES
        return positions_bytes + self.values.numel() * self.values.element_size()


class DeltaEncoder:
    """Sender side: diffs each tensor against the snapshot of what was last sent.

    Snapshots live in host memory, one per tensor (the same size as the model in its transport
    dtype). :meth:`encode` updates the snapshot as if the payload will arrive; if a transfer
    fails, call :meth:`reset` so that the next one is a full seed.
    """

    def __init__(self) -> None:
        self._snapshots: dict[str, torch.Tensor] = {}
        self.full_bytes_total = 0
        """Bytes the encoded tensors would have cost sent in full."""
        self.sent_bytes_total = 0
        """Bytes of the payloads actually produced."""

    @property
    def bytes_saved(self) -> int:
        return self.full_bytes_total - self.sent_bytes_total

    def reset(self, name: str | None = None) -> None:
        """Forget one snapshot (or all): the next :meth:`encode` of it sends the full tensor."""
        if name is None:
            self._snapshots.clear()
        else:
            self._snapshots.pop(name, None)

    def encode(self, name: str, tensor: torch.Tensor) -> DeltaPayload:
        """The payload that turns the receiver's previous ``name`` into ``tensor``."""
        # A copy we own: the caller keeps training on ``tensor`` after this returns, and the
        # copy serves both as the next snapshot and as the full payload's values.
        new = tensor.detach().to("cpu", copy=True).contiguous()
        checksum = tensor_sha256(new)
        full_bytes = new.numel() * new.element_size()
        old = self._snapshots.get(name)
        payload: DeltaPayload | None = None
        if old is not None and old.shape == new.shape and old.dtype == new.dtype:
            positions = torch.nonzero(_bits(new) != _bits(old)).reshape(-1)
            sparse_bytes = positions.numel() * (_POSITION_BYTES + new.element_size())
            if sparse_bytes < full_bytes:
                payload = DeltaPayload(
                    name=name,
                    kind="sparse",
                    shape=tuple(new.shape),
                    dtype=new.dtype,
                    positions=positions,
                    values=new.reshape(-1)[positions],
                    checksum=checksum,
                )
        if payload is None:
            payload = DeltaPayload(
                name=name,
                kind="full",
                shape=tuple(new.shape),
                dtype=new.dtype,
                positions=None,
                values=new,
                checksum=checksum,
            )
        self._snapshots[name] = new
        self.full_bytes_total += full_bytes
        self.sent_bytes_total += payload.nbytes
        return payload


class DeltaDecoder:
    """Receiver side: applies payloads to the tensor it holds and checks the result."""

    def apply(
        self, name: str, base_tensor: torch.Tensor | None, payload: DeltaPayload
    ) -> torch.Tensor:
        """Return the new tensor (``base_tensor`` is not modified; None is allowed for a full
        payload). Raises :class:`DeltaChecksumError` when the result's sha256 differs from the
        sender's, ValueError on a name/shape/dtype mismatch."""
        if payload.name != name:
            raise ValueError(f"payload for {payload.name!r} applied to {name!r}")
        if payload.kind == "full":
            new = payload.values.reshape(payload.shape).clone()
        else:
            if base_tensor is None:
                raise ValueError(f"sparse delta for {name!r} needs the previous tensor as base")
            if tuple(base_tensor.shape) != payload.shape or base_tensor.dtype != payload.dtype:
                raise ValueError(
                    f"{name!r}: base is {base_tensor.dtype} {tuple(base_tensor.shape)}, the delta "
                    f"was made against {payload.dtype} {payload.shape}; re-seed with a full sync"
                )
            assert payload.positions is not None
            new = base_tensor.detach().clone().contiguous()
            flat = new.view(-1)
            flat[payload.positions.to(flat.device)] = payload.values.to(flat.device)
        actual = tensor_sha256(new)
        if actual != payload.checksum:
            raise DeltaChecksumError(
                f"{name!r}: rebuilt tensor sha256 {actual[:16]}… != sender's "
                f"{payload.checksum[:16]}…; the base differs from the sender's snapshot"
            )
        return new
