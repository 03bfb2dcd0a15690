"""Delta buckets (relayrl.dataplane.delta): what changed, bitwise, at the bucket's element width;
never larger than the bucket; applied only to the base it was made from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relayrl.dataplane.delta import HEADER, DeltaError, apply, encode


def bf16_bucket(n: int, seed: int = 0) -> bytes:
    torch.manual_seed(seed)
    return (torch.randn(n) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def changed(bucket: bytes, fraction: float, seed: int = 1) -> bytes:
    elements = np.frombuffer(bucket, dtype="<u2").copy()
    where = np.random.default_rng(seed).random(elements.size) < fraction
    elements[where] ^= 1  # the last mantissa bit: a bf16 update of one unit
    return elements.tobytes()


def test_a_sparse_change_round_trips_in_six_bytes_per_changed_weight() -> None:
    base = bf16_bucket(100_000)
    new = changed(base, 0.01)
    delta = encode(base, new)
    n = int(np.count_nonzero(np.frombuffer(base, "<u2") != np.frombuffer(new, "<u2")))
    assert delta is not None and len(delta) == HEADER.size + 6 * n
    assert apply(base, delta) == new


def test_an_unchanged_bucket_is_a_header_and_a_dense_change_is_sent_in_full() -> None:
    base = bf16_bucket(10_000)
    assert len(encode(base, base)) == HEADER.size
    assert apply(base, encode(base, base)) == base
    # 6 bytes per changed element against 2 per element: past a third changed, full is smaller
    assert encode(base, changed(base, 0.5)) is None
    assert encode(base, changed(base, 0.2)) is not None


def test_every_bit_pattern_counts_negative_zero_and_nans_included() -> None:
    values = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 64, dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy().view("<u2")
    base = bits.tobytes()
    flipped = bits.copy()
    flipped[0] = 0x8000  # -0.0: equal as numbers, not as bits
    flipped[2] |= 1  # another NaN
    assert torch.frombuffer(bytearray(flipped.tobytes()), dtype=torch.bfloat16)[2].isnan()
    new = flipped.tobytes()
    delta = encode(base, new)
    assert delta is not None and len(delta) == HEADER.size + 2 * 6
    assert apply(base, delta) == new


def test_an_odd_sized_bucket_is_compared_byte_by_byte() -> None:
    base = bytes(range(255)) * 3  # 765 bytes: FP8 weights can make an odd bucket
    new = bytearray(base)
    new[10] ^= 0xFF
    delta = encode(base, bytes(new))
    assert delta is not None and len(delta) == HEADER.size + 5
    assert apply(base, delta) == bytes(new)


def test_a_delta_refuses_a_base_it_was_not_made_for() -> None:
    base = bf16_bucket(1000)
    delta = encode(base, changed(base, 0.01))
    assert delta is not None
    with pytest.raises(DeltaError, match="element width"):
        apply(base[:-1], delta)  # an odd size: another bucket
    with pytest.raises(DeltaError, match="do not hold"):
        apply(base, delta[:-1])
    with pytest.raises(DeltaError, match="no header"):
        apply(base, b"\x02")
    with pytest.raises(DeltaError, match="inside the base"):
        apply(base[: len(base) // 4], delta)  # positions past its end
    backwards = bytearray(delta)
    count = HEADER.unpack_from(delta)[1]
    positions = np.frombuffer(delta, "<u4", count, HEADER.size)[::-1].tobytes()
    backwards[HEADER.size : HEADER.size + 4 * count] = positions
    if count > 1:
        with pytest.raises(DeltaError, match="increasing"):
            apply(base, bytes(backwards))
    with pytest.raises(ValueError, match="equal sizes"):
        encode(base, base[:-2])
