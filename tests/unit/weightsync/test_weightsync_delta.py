"""Delta mode: full seed, sparse updates that rebuild the tensor bit-exactly, checksum detection
of a drifted base, and bytes-saved accounting."""

from __future__ import annotations

import pytest
import torch

from relayrl.transfer.delta import (
    DeltaChecksumError,
    DeltaDecoder,
    DeltaEncoder,
    DeltaPayload,
    tensor_sha256,
)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_sha256(a) == tensor_sha256(b)


def perturb(t: torch.Tensor, fraction: float, seed: int = 0) -> tuple[torch.Tensor, int]:
    """A copy of ``t`` with ``fraction`` of its elements changed (bitwise), and their count."""
    gen = torch.Generator().manual_seed(seed)
    new = t.clone()
    flat = new.view(-1)
    num_changed = int(flat.numel() * fraction)
    idx = torch.randperm(flat.numel(), generator=gen)[:num_changed]
    flat[idx] = (flat[idx].float() + 1.0).to(t.dtype)
    return new, num_changed


def test_first_transfer_is_a_full_seed() -> None:
    w = torch.randn(64, 32).bfloat16()
    payload = DeltaEncoder().encode("w", w)
    assert payload.kind == "full" and payload.positions is None
    assert payload.checksum == tensor_sha256(w)
    assert bits_equal(DeltaDecoder().apply("w", None, payload), w)


def test_one_percent_changed_round_trips_and_saves_bytes() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    w0 = torch.randn(200, 500).bfloat16()  # 100k elements
    base = decoder.apply("w", None, encoder.encode("w", w0))
    w1, num_changed = perturb(w0, 0.01)

    payload = encoder.encode("w", w1)
    assert payload.kind == "sparse"
    assert payload.positions is not None and payload.positions.dtype == torch.int64
    assert payload.positions.numel() == num_changed == 1000
    assert payload.values.dtype == torch.bfloat16
    assert payload.nbytes == num_changed * (8 + 2)
    rebuilt = decoder.apply("w", base, payload)
    assert bits_equal(rebuilt, w1)
    assert bits_equal(base, w0), "apply must not modify the base"

    full_bytes = w0.numel() * 2
    assert encoder.full_bytes_total == 2 * full_bytes
    assert encoder.bytes_saved == full_bytes - num_changed * 10  # ~95% of the second transfer


def test_checksum_mismatch_on_a_drifted_base_is_detected() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    w0 = torch.randn(1000)
    encoder.encode("w", w0)
    w1, _ = perturb(w0, 0.01)
    payload = encoder.encode("w", w1)
    drifted = w0.clone()
    unchanged = int(torch.nonzero(w1 == w0)[0])
    drifted[unchanged] += 1.0  # the receiver missed an update the sender already diffed out
    with pytest.raises(DeltaChecksumError, match="'w'"):
        decoder.apply("w", drifted, payload)


def test_tampered_values_are_detected() -> None:
    encoder = DeltaEncoder()
    w0 = torch.randn(1000)
    encoder.encode("w", w0)
    w1, _ = perturb(w0, 0.05)
    good = encoder.encode("w", w1)
    assert good.positions is not None
    bad = DeltaPayload(
        good.name, good.kind, good.shape, good.dtype, good.positions, good.values + 1, good.checksum
    )
    with pytest.raises(DeltaChecksumError):
        DeltaDecoder().apply("w", w0, bad)


def test_comparison_is_bitwise_for_signed_zero_and_nan() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    w0 = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 10)
    base = decoder.apply("w", None, encoder.encode("w", w0))
    w1 = w0.clone()
    w1[0] = -0.0  # == 0.0, but different bits
    payload = encoder.encode("w", w1)
    assert payload.positions is not None
    assert payload.positions.tolist() == [0]  # NaN != NaN is not taken for a change
    assert bits_equal(decoder.apply("w", base, payload), w1)


def test_dense_change_falls_back_to_a_full_transfer() -> None:
    encoder = DeltaEncoder()
    w0 = torch.randn(1000).bfloat16()
    encoder.encode("w", w0)
    w1, _ = perturb(w0, 0.5)  # 50% > the bf16 break-even 2 / (8 + 2)
    payload = encoder.encode("w", w1)
    assert payload.kind == "full"
    assert encoder.bytes_saved == 0


def test_unchanged_tensor_sends_nothing_but_the_checksum() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    w = torch.randn(300, 7)
    base = decoder.apply("w", None, encoder.encode("w", w))
    payload = encoder.encode("w", w)
    assert payload.kind == "sparse" and payload.nbytes == 0
    assert bits_equal(decoder.apply("w", base, payload), w)


def test_snapshot_is_a_copy_so_in_place_training_is_seen_as_a_change() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    w = torch.randn(100)
    base = decoder.apply("w", None, encoder.encode("w", w))
    with torch.no_grad():
        w[3] += 1.0  # the optimizer updates the parameter in place
    payload = encoder.encode("w", w)
    assert payload.positions is not None and payload.positions.tolist() == [3]
    assert bits_equal(decoder.apply("w", base, payload), w)


def test_reset_and_shape_change_force_a_full_seed() -> None:
    encoder = DeltaEncoder()
    encoder.encode("a", torch.randn(10))
    encoder.encode("b", torch.randn(10))
    encoder.reset("a")
    assert encoder.encode("a", torch.randn(10)).kind == "full"
    assert encoder.encode("b", torch.randn(11)).kind == "full"
    encoder.reset()
    assert encoder.encode("b", torch.randn(11)).kind == "full"


def test_decoder_rejects_mismatched_base_and_name() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    w0 = torch.randn(50)
    encoder.encode("w", w0)
    payload = encoder.encode("w", perturb(w0, 0.02)[0])
    with pytest.raises(ValueError, match="re-seed"):
        decoder.apply("w", w0.bfloat16(), payload)
    with pytest.raises(ValueError, match="needs the previous tensor"):
        decoder.apply("w", None, payload)
    with pytest.raises(ValueError, match="applied to 'v'"):
        decoder.apply("v", w0, payload)
