"""Delta versions: a packed bucket sent as what changed since the same bucket of the last
committed version (docs/weightsync.md#delta-versions).

At RL learning rates most bf16 weights do not change from one step to the next: an update
smaller than half a unit in the last place rounds back to the same bf16 value. A bucket is
compared with its base bitwise, as integers of the bucket's element width (2 bytes: a bf16
weight, half of an fp32 scale), so -0.0, NaN payloads and every other bit pattern survive.

Wire format of a delta (little-endian):

    width   uint8      element width in bytes (1 or 2)
    pad     3 bytes    zero
    count   uint32     changed elements
    index   count x uint32, strictly increasing: the changed elements' positions
    value   count x <width> bytes: their new bit patterns

A bucket is sent as a delta only when that is smaller than the bucket itself. The receiver
rebuilds the full bucket and checks the sha256 of the full bucket, which the sender sends in
both cases: a delta never produces bytes other than the full export's.
"""

from __future__ import annotations

import struct

import numpy as np

HEADER = struct.Struct("<B3xI")
INDEX = np.dtype("<u4")
_UINT = {1: np.dtype("u1"), 2: np.dtype("<u2")}


class DeltaError(ValueError):
    """A delta that cannot be applied to its base (malformed, or another base's)."""


def element_width(size_bytes: int) -> int:
    """The element width buckets of this size are compared at: 2 bytes when it divides it."""
    return 2 if size_bytes % 2 == 0 else 1


def encode(base: bytes | memoryview, new: bytes | memoryview) -> bytes | None:
    """The delta turning `base` into `new` (equal sizes), or None when it would not be
    smaller than `new` itself (send the bucket in full)."""
    if len(base) != len(new):
        raise ValueError(f"a delta needs equal sizes, got {len(base)} and {len(new)} bytes")
    width = element_width(len(new))
    if len(new) // width > np.iinfo(INDEX).max:
        return None  # positions would not fit: too large a bucket for this format
    old_elements = np.frombuffer(base, dtype=_UINT[width])
    new_elements = np.frombuffer(new, dtype=_UINT[width])
    positions = np.flatnonzero(old_elements != new_elements)
    size = HEADER.size + positions.size * (INDEX.itemsize + width)
    if size >= len(new):
        return None
    return b"".join(
        (
            HEADER.pack(width, positions.size),
            positions.astype(INDEX).tobytes(),
            new_elements[positions].tobytes(),
        )
    )


def apply(base: bytes | memoryview, delta: bytes | memoryview) -> bytes:
    """The full bucket `delta` makes of `base`; DeltaError when it does not fit that base."""
    if len(delta) < HEADER.size:
        raise DeltaError(f"a delta of {len(delta)} bytes has no header")
    width, count = HEADER.unpack_from(delta)
    if width != element_width(len(base)):
        raise DeltaError(f"element width {width} does not fit a base of {len(base)} bytes")
    if len(delta) != HEADER.size + count * (INDEX.itemsize + width):
        raise DeltaError(f"{len(delta)} bytes do not hold the {count} changes its header says")
    positions = np.frombuffer(delta, dtype=INDEX, count=count, offset=HEADER.size)
    values = np.frombuffer(
        delta, dtype=_UINT[width], count=count, offset=HEADER.size + count * INDEX.itemsize
    )
    steps = np.diff(positions.astype(np.int64))
    if count and (positions[-1] >= len(base) // width or np.any(steps <= 0)):
        raise DeltaError("its positions are not increasing positions inside the base")
    out = bytearray(base)
    np.frombuffer(out, dtype=_UINT[width])[positions] = values
    return bytes(out)
