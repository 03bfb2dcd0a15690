"""The bucket plan: layout invariants, determinism, proto round trip, pack -> assemble bit-exact,
ordering and checksum errors, and the double-buffered packer."""

from __future__ import annotations

import threading

import pytest
import torch

from relayrl.dataplane.plan import (
    BucketAssembler,
    BucketChecksumError,
    BucketLayout,
    BucketOrderError,
    DoubleBufferedPacker,
    IncompleteTransferError,
    Piece,
    PlanMismatchError,
    TensorSpec,
    as_byte_view,
    bucket_sha256,
    layouts_from_pieces,
    pack_bucket,
    plan_buckets,
    plan_digest,
    verify_plan_digest,
)
from relayrl.proto.common.v1 import common_pb2

# --- helpers ------------------------------------------------------------------------------------


def qwen2_like(num_layers: int = 2, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensors with the names and shape ratios of a (tiny) Qwen2: GQA with biased q/k/v."""
    vocab, hidden, inter, heads, kv_heads = 1000, 64, 176, 4, 2
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.q_proj.bias": (heads * head_dim,),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.bias": (kv_heads * head_dim,),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.bias": (kv_heads * head_dim,),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.from_tensor(n, t) for n, t in tensors.items()]


def check_invariants(
    plan: list[BucketLayout], specs: list[TensorSpec], bucket_size_bytes: int, alignment: int
) -> None:
    """What every plan must satisfy, whatever its input."""
    assert [b.index for b in plan] == list(range(len(plan)))
    for b in plan:
        assert b.size_bytes <= bucket_size_bytes
        end_bytes = 0
        for p in b.pieces:
            assert p.bucket_index == b.index
            assert p.offset_bytes % alignment == 0
            assert p.offset_bytes >= end_bytes, "pieces overlap"
            end_bytes = p.offset_bytes + p.size_bytes
            assert end_bytes <= b.size_bytes
    for b in plan[:-1]:
        # only the last bucket may be partly empty; others lose at most the alignment padding
        assert b.size_bytes > bucket_size_bytes - alignment
    pieces = [p for b in plan for p in b.pieces]
    # tensors appear in input order, each as contiguous chunks over consecutive buckets
    assert list(dict.fromkeys(p.name for p in pieces)) == [s.name for s in specs]
    for spec in specs:
        mine = [p for p in pieces if p.name == spec.name]
        assert sum(p.size_bytes for p in mine) == spec.nbytes
        chunk_at = 0
        for k, p in enumerate(mine):
            assert p.chunk_offset_bytes == chunk_at and p.total_bytes == spec.nbytes
            assert p.shape == spec.shape and p.dtype == spec.dtype
            chunk_at += p.size_bytes
            if k:
                assert p.bucket_index == mine[k - 1].bucket_index + 1
                assert p.offset_bytes == 0


def round_trip(
    tensors: dict[str, torch.Tensor], bucket_size_bytes: int, alignment: int = 64
) -> dict[str, torch.Tensor]:
    plan = plan_buckets(specs_of(tensors), bucket_size_bytes, alignment=alignment)
    check_invariants(plan, specs_of(tensors), bucket_size_bytes, alignment)
    out = torch.empty(bucket_size_bytes, dtype=torch.uint8)
    assembler = BucketAssembler(plan)
    received: dict[str, torch.Tensor] = {}
    for layout in plan:
        view = pack_bucket(layout, tensors, out)
        for name, t in assembler.feed(layout.index, view, expected_sha256=bucket_sha256(view)):
            assert name not in received
            received[name] = t
    assembler.finish()
    return received


def assert_bit_exact(sent: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
    assert list(received) == list(sent)
    for name, t in sent.items():
        r = received[name]
        assert r.dtype == t.dtype and r.shape == t.shape, name
        assert torch.equal(as_byte_view(r), as_byte_view(t)), name


# --- plan layout --------------------------------------------------------------------------------


def test_small_tensors_share_a_bucket_and_large_ones_are_split() -> None:
    specs = [
        TensorSpec("a", (10,), "float32"),  # 40 bytes
        TensorSpec("big", (700,), "float32"),  # 2800 bytes: spans 3+ buckets of 1 KiB
        TensorSpec("c", (3,), "bfloat16"),
    ]
    plan = plan_buckets(specs, 1024, alignment=64)
    check_invariants(plan, specs, 1024, 64)
    big = [p for b in plan for p in b.pieces if p.name == "big"]
    assert [(p.bucket_index, p.offset_bytes, p.size_bytes) for p in big] == [
        (0, 64, 960),
        (1, 0, 1024),
        (2, 0, 816),
    ]
    c = plan[2].pieces[-1]
    assert (c.name, c.offset_bytes, c.size_bytes) == ("c", 832, 6)
    assert plan[2].size_bytes == 838


def test_exactly_bucket_sized_tensors_fill_one_bucket_each() -> None:
    specs = [TensorSpec(f"w{i}", (256,), "float32") for i in range(3)]  # 1024 bytes each
    plan = plan_buckets(specs, 1024)
    check_invariants(plan, specs, 1024, 64)
    assert [[(p.name, p.offset_bytes, p.size_bytes) for p in b.pieces] for b in plan] == [
        [("w0", 0, 1024)],
        [("w1", 0, 1024)],
        [("w2", 0, 1024)],
    ]


def test_zero_size_tensors_are_zero_byte_pieces() -> None:
    specs = [
        TensorSpec("empty_first", (0,), "float32"),
        TensorSpec("full", (256,), "float32"),  # exactly fills bucket 0
        TensorSpec("empty_after_full", (0, 5), "bfloat16"),
        TensorSpec("x", (3,), "float32"),
        TensorSpec("empty_last", (2, 0), "float8_e4m3fn"),
    ]
    plan = plan_buckets(specs, 1024)
    check_invariants(plan, specs, 1024, 64)
    by_name = {p.name: p for b in plan for p in b.pieces}
    assert (by_name["empty_first"].bucket_index, by_name["empty_first"].size_bytes) == (0, 0)
    # a zero-byte piece never opens a bucket of its own
    assert (by_name["empty_after_full"].bucket_index, by_name["empty_after_full"].offset_bytes) == (
        0,
        1024,
    )
    assert len(plan) == 2 and by_name["empty_last"].bucket_index == 1

    tensors = {
        "empty_first": torch.empty(0),
        "full": torch.randn(256),
        "empty_after_full": torch.empty(0, 5, dtype=torch.bfloat16),
        "x": torch.randn(3),
        "empty_last": torch.empty(2, 0, dtype=torch.float8_e4m3fn),
    }
    assert_bit_exact(tensors, round_trip(tensors, 1024))


def test_only_zero_size_tensors_and_no_tensors() -> None:
    assert plan_buckets([], 1024) == []
    plan = plan_buckets([TensorSpec("e", (0,), "float32")], 1024)
    assert len(plan) == 1 and plan[0].size_bytes == 0


@pytest.mark.parametrize(
    ("bucket_size_bytes", "alignment", "message"),
    [(32, 64, "smaller than alignment"), (1000, 64, "multiple of alignment"), (64, 0, "positive")],
)
def test_bad_bucket_size_is_rejected(bucket_size_bytes: int, alignment: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_buckets([TensorSpec("a", (1,), "float32")], bucket_size_bytes, alignment=alignment)


def test_bad_names_and_dtypes_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty name"):
        plan_buckets([TensorSpec("", (1,), "float32")], 1024)
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        plan_buckets([TensorSpec("a", (1,), "float32"), TensorSpec("a", (2,), "float32")], 1024)
    with pytest.raises(ValueError, match="unsupported dtype"):
        TensorSpec("a", (1,), "float64")
    with pytest.raises(ValueError, match="cannot carry"):
        TensorSpec.from_tensor("a", torch.zeros(1, dtype=torch.float64))


# --- determinism, digest, proto -----------------------------------------------------------------


def test_plan_is_deterministic_and_digest_detects_any_difference() -> None:
    specs = specs_of(qwen2_like())
    plan = plan_buckets(specs, 4096)
    again = plan_buckets([TensorSpec(s.name, s.shape, s.dtype) for s in specs], 4096)
    assert plan == again and plan_digest(plan) == plan_digest(again)
    verify_plan_digest(again, plan_digest(plan))

    other_size = plan_buckets(specs, 8192)
    reshaped = [*specs[:-1], TensorSpec(specs[-1].name, (1, *specs[-1].shape), specs[-1].dtype)]
    renamed = [*specs[:-1], TensorSpec("lm_head.weight.x", specs[-1].shape, specs[-1].dtype)]
    digests = {plan_digest(p) for p in (plan, other_size, plan_buckets(reshaped, 4096))}
    digests.add(plan_digest(plan_buckets(renamed, 4096)))
    assert len(digests) == 4
    with pytest.raises(PlanMismatchError, match="disagree"):
        verify_plan_digest(other_size, plan_digest(plan))


def test_pieces_round_trip_through_tensor_meta_and_rebuild_the_plan() -> None:
    specs = [
        TensorSpec("w", (300, 7), "float8_e4m3fn", "fp8_block_128", "w_scale_inv"),
        TensorSpec("w_scale_inv", (3, 1), "float32"),
        TensorSpec("b", (5,), "bfloat16"),
        TensorSpec("h", (9,), "float16", "none"),
    ]
    plan = plan_buckets(specs, 512)
    wire = [
        common_pb2.TensorMeta.FromString(p.to_proto().SerializeToString())
        for b in plan
        for p in b.pieces
    ]
    assert wire[0].dtype == common_pb2.DTYPE_FLOAT8_E4M3
    assert wire[0].quantization == common_pb2.QUANTIZATION_FP8_BLOCK_128
    pieces = [Piece.from_proto(m) for m in wire]
    assert pieces == [p for b in plan for p in b.pieces]
    assert plan_digest(layouts_from_pieces(pieces)) == plan_digest(plan)


def test_tensor_meta_with_unset_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        Piece.from_proto(common_pb2.TensorMeta(name="w", shape=[2]))
    meta = common_pb2.TensorMeta(name="w", shape=[2], dtype=common_pb2.DTYPE_BFLOAT16)
    assert Piece.from_proto(meta).quantization == "none"  # proto3 default means unquantised


# --- pack -> assemble ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("bucket_size_bytes", [1024, 4096, 1 << 20])
def test_qwen2_like_round_trip_is_bit_exact(dtype: torch.dtype, bucket_size_bytes: int) -> None:
    tensors = qwen2_like(dtype=dtype)
    assert_bit_exact(tensors, round_trip(tensors, bucket_size_bytes))


def test_mixed_dtypes_and_non_contiguous_tensors_round_trip() -> None:
    base = torch.randn(40, 30)
    tensors = {
        "t": base.t(),  # non-contiguous
        "bf": torch.randn(333).bfloat16(),
        "fp8": torch.randn(17, 5).to(torch.float8_e4m3fn),
        "half": torch.randn(2, 3, 4).half(),
        "scalar": torch.tensor(3.5),
        "idx": torch.arange(7, dtype=torch.int64),
    }
    assert_bit_exact(tensors, round_trip(tensors, 256, alignment=16))


def test_an_odd_number_of_buckets_round_trips() -> None:
    tensors = {f"w{i}": torch.randn(100) for i in range(4)}  # 1600 bytes -> 5 buckets of 384
    plan = plan_buckets(specs_of(tensors), 384)
    assert len(plan) == 5
    assert_bit_exact(tensors, round_trip(tensors, 384))


def test_a_bucket_can_complete_several_tensors_and_a_split_one_completes_last() -> None:
    tensors = {"big": torch.randn(600), "s1": torch.randn(4), "s2": torch.randn(4)}
    plan = plan_buckets(specs_of(tensors), 1024)  # big: 2400 bytes over 3 buckets
    assembler = BucketAssembler(plan)
    out = torch.empty(1024, dtype=torch.uint8)
    completed = [
        [n for n, _ in assembler.feed(b.index, pack_bucket(b, tensors, out))] for b in plan
    ]
    assert completed == [[], [], ["big", "s1", "s2"]]


def test_assembled_tensors_do_not_alias_the_bucket_buffer() -> None:
    tensors = {"a": torch.randn(8), "b": torch.randn(300)}
    plan = plan_buckets(specs_of(tensors), 1024)
    out = torch.empty(1024, dtype=torch.uint8)
    assembler = BucketAssembler(plan)
    received = {}
    for b in plan:
        received |= dict(assembler.feed(b.index, pack_bucket(b, tensors, out)))
        out.fill_(0xFF)  # the transport reuses its buffer for the next bucket
    assert_bit_exact(tensors, received)


def test_streaming_a_bucket_hands_out_one_tensor_at_a_time() -> None:
    tensors = {"a": torch.randn(8), "b": torch.randn(8), "c": torch.randn(8)}
    (bucket,) = plan_buckets(specs_of(tensors), 1024)
    assembler = BucketAssembler([bucket])
    stream = assembler.stream(0, pack_bucket(bucket, tensors, torch.empty(1024, dtype=torch.uint8)))
    name, first = next(stream)
    assert name == "a" and torch.equal(first, tensors["a"])
    assert assembler.num_buckets_received == 0  # received once the stream is exhausted
    assert [n for n, _ in stream] == ["b", "c"]
    assert assembler.num_buckets_received == 1
    assembler.finish()


def test_assembler_accepts_bytes_and_memoryview() -> None:
    tensors = {"a": torch.randn(50).bfloat16(), "b": torch.randn(90)}
    plan = plan_buckets(specs_of(tensors), 256)
    out = torch.empty(256, dtype=torch.uint8)
    assembler = BucketAssembler(plan)
    received = {}
    for b in plan:
        raw = pack_bucket(b, tensors, out).numpy().tobytes()
        data = raw if b.index % 2 else memoryview(raw)
        received |= dict(assembler.feed(b.index, data, expected_sha256=bucket_sha256(raw)))
    assembler.finish()
    assert_bit_exact(tensors, received)


def test_pack_checks_dtype_shape_and_presence_naming_the_tensor() -> None:
    tensors = {"model.w": torch.randn(4, 4)}
    (layout,) = plan_buckets(specs_of(tensors), 1024)
    out = torch.empty(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'model.w' is torch.bfloat16"):
        pack_bucket(layout, {"model.w": torch.randn(4, 4).bfloat16()}, out)
    with pytest.raises(ValueError, match=r"'model.w' is torch.float32 \(2, 8\)"):
        pack_bucket(layout, {"model.w": torch.randn(2, 8)}, out)
    with pytest.raises(KeyError, match=r"model\.w"):
        pack_bucket(layout, {}, out)
    with pytest.raises(ValueError, match="needs 64 bytes"):
        pack_bucket(layout, tensors, torch.empty(32, dtype=torch.uint8))


def test_padding_is_zeroed_so_checksums_do_not_depend_on_buffer_history() -> None:
    tensors = {"a": torch.randn(3), "b": torch.randn(3)}  # 12 bytes then padding to 64
    (layout,) = plan_buckets(specs_of(tensors), 1024)
    dirty = torch.full((1024,), 0xAB, dtype=torch.uint8)
    clean = torch.zeros(1024, dtype=torch.uint8)
    assert bucket_sha256(pack_bucket(layout, tensors, dirty)) == bucket_sha256(
        pack_bucket(layout, tensors, clean)
    )


def test_out_of_order_and_repeated_buckets_are_rejected() -> None:
    tensors = {f"w{i}": torch.randn(256) for i in range(3)}
    plan = plan_buckets(specs_of(tensors), 1024)
    out = torch.empty(1024, dtype=torch.uint8)
    assembler = BucketAssembler(plan)
    with pytest.raises(BucketOrderError, match="received bucket 1, expected bucket 0"):
        assembler.feed(1, pack_bucket(plan[1], tensors, out))
    assembler.feed(0, pack_bucket(plan[0], tensors, out))
    with pytest.raises(BucketOrderError, match="received bucket 0, expected bucket 1"):
        assembler.feed(0, pack_bucket(plan[0], tensors, out))


def test_corrupted_bucket_is_detected_by_sha256() -> None:
    tensors = {"w": torch.randn(1000)}
    plan = plan_buckets(specs_of(tensors), 1024)
    out = torch.empty(1024, dtype=torch.uint8)
    view = pack_bucket(plan[0], tensors, out)
    sha256 = bucket_sha256(view)
    view[100] ^= 0x01  # one flipped bit in transit
    assembler = BucketAssembler(plan)
    with pytest.raises(BucketChecksumError, match="bucket 0"):
        assembler.feed(0, view, expected_sha256=sha256)


def test_finish_reports_missing_buckets_and_incomplete_tensors() -> None:
    tensors = {"w": torch.randn(600)}  # 2400 bytes over 3 buckets
    plan = plan_buckets(specs_of(tensors), 1024)
    out = torch.empty(1024, dtype=torch.uint8)
    assembler = BucketAssembler(plan)
    assembler.feed(0, pack_bucket(plan[0], tensors, out))
    with pytest.raises(IncompleteTransferError, match=r"1 of 3 buckets; 'w' is incomplete"):
        assembler.finish()


def test_truncated_bucket_is_rejected() -> None:
    tensors = {"w": torch.randn(100)}
    plan = plan_buckets(specs_of(tensors), 1024)
    with pytest.raises(ValueError, match="carries 10 bytes"):
        BucketAssembler(plan).feed(0, bytes(10))


# --- double-buffered packer ---------------------------------------------------------------------


@pytest.mark.parametrize("num_tensors", [0, 1, 4, 7])
def test_double_buffered_packer_gives_the_bytes_of_sequential_packing(num_tensors: int) -> None:
    tensors = {f"w{i}": torch.randn(97 + 13 * i).bfloat16() for i in range(num_tensors)}
    plan = plan_buckets(specs_of(tensors), 256)
    out = torch.empty(256, dtype=torch.uint8)
    expected = [pack_bucket(b, tensors, out).clone() for b in plan]
    got = []
    with DoubleBufferedPacker(plan, tensors, 256) as packer:
        for index, view, sha256 in packer:
            assert sha256 == bucket_sha256(expected[index])
            got.append(view.clone())
            packer.release(index)
    assert len(got) == len(expected)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_double_buffered_packer_packs_the_next_bucket_while_the_caller_holds_this_one() -> None:
    # one bucket-sized tensor per bucket, so the packer's lookups tell which bucket it packs
    tensors = {f"w{i}": torch.randn(256) for i in range(5)}
    plan = plan_buckets(specs_of(tensors), 1024)
    started = {i: threading.Event() for i in range(len(plan))}

    def source(name: str) -> torch.Tensor:
        started[int(name[1:])].set()
        return tensors[name]

    with DoubleBufferedPacker(plan, source, 1024) as packer:
        for index, _view, _sha256 in packer:
            if index + 1 < len(plan):
                # bucket index is still held (not released): packing index+1 must already run
                assert started[index + 1].wait(timeout=30)
            packer.release(index)


def test_double_buffered_packer_raises_instead_of_reusing_a_held_buffer() -> None:
    tensors = {f"w{i}": torch.randn(256) for i in range(4)}
    plan = plan_buckets(specs_of(tensors), 1024)
    with DoubleBufferedPacker(plan, tensors, 1024) as packer:
        assert next(packer)[0] == 0
        assert next(packer)[0] == 1  # holding two buckets at once is allowed
        with pytest.raises(BucketOrderError, match="before releasing bucket 0"):
            next(packer)
        with pytest.raises(BucketOrderError, match="not held"):
            packer.release(3)
        packer.release(0)
        assert next(packer)[0] == 2
        with pytest.raises(BucketOrderError, match="not held"):
            packer.release(0)


def test_double_buffered_packer_surfaces_packing_errors_and_checks_buffer_size() -> None:
    tensors = {"w0": torch.randn(256), "w1": torch.randn(256)}
    plan = plan_buckets(specs_of(tensors), 1024)
    with pytest.raises(ValueError, match="1024-byte bucket, buffers hold 512"):
        DoubleBufferedPacker(plan, tensors, 512)
    with DoubleBufferedPacker(plan, {"w0": tensors["w0"]}, 1024) as packer:
        assert next(packer)[0] == 0
        with pytest.raises(KeyError, match="w1"):
            next(packer)
