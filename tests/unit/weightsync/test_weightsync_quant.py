"""FP8 e4m3 transport quantisation: round trip within the documented bound, block vs per-tensor
on outliers, zero tensors, ragged shapes, byte savings and which tensors are quantised."""

from __future__ import annotations

import pytest
import torch

from relayrl.dataplane.plan import BucketAssembler, pack_bucket, plan_buckets
from relayrl.dataplane.quant import (
    FP8_DTYPE,
    QuantMode,
    dequantize_fp8,
    fp8_error_bound,
    quantize_fp8,
    quantize_named_tensors,
    scale_name,
    scale_shape,
    should_quantize,
)

MODES: tuple[QuantMode, ...] = ("per_tensor", "block_128")


def weight(rows: int, cols: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * std).bfloat16()


def qwen2_0_5b_layer_linears() -> dict[str, tuple[int, int]]:
    """The linear weights of one Qwen2-0.5B decoder layer (hidden 896, 14 heads, 2 KV heads)."""
    hidden, inter, head_dim = 896, 4864, 64
    p = "model.layers.0"
    return {
        f"{p}.self_attn.q_proj.weight": (14 * head_dim, hidden),
        f"{p}.self_attn.k_proj.weight": (2 * head_dim, hidden),
        f"{p}.self_attn.v_proj.weight": (2 * head_dim, hidden),
        f"{p}.self_attn.o_proj.weight": (hidden, 14 * head_dim),
        f"{p}.mlp.gate_proj.weight": (inter, hidden),
        f"{p}.mlp.up_proj.weight": (inter, hidden),
        f"{p}.mlp.down_proj.weight": (hidden, inter),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (127, 129), (130, 200), (256, 384), (128, 128), (3, 1000)]
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_the_bound(
    mode: QuantMode, shape: tuple[int, int], out_dtype: torch.dtype
) -> None:
    x = weight(*shape, seed=shape[0] * 1000 + shape[1])
    q, scale = quantize_fp8(x, mode)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(shape, mode)
    x_hat = dequantize_fp8(q, scale, mode, dtype=out_dtype)
    assert x_hat.dtype == out_dtype
    err = (x_hat.float() - x.float()).abs()
    bound = fp8_error_bound(x, scale, mode, out_dtype=out_dtype)
    assert bool((err <= bound).all()), f"worst err/bound {float((err / bound).max()):.3f}"


def test_bound_is_not_vacuous() -> None:
    x = weight(512, 512)
    for mode in MODES:
        q, scale = quantize_fp8(x, mode)
        err = (dequantize_fp8(q, scale, mode, dtype=torch.float32) - x.float()).abs()
        ratio = err / fp8_error_bound(x, scale, mode)
        assert 0.5 < float(ratio.max()) <= 1.0


def test_block_scales_contain_an_outlier_that_ruins_a_per_tensor_scale() -> None:
    x = weight(512, 512).float()  # std 0.02
    x[300, 400] = 1e4  # one huge value in block (2, 3)
    outside = torch.ones_like(x, dtype=torch.bool)
    outside[256:384, 384:512] = False

    rel_err, flushed_to_zero = {}, {}
    for mode in MODES:
        q, scale = quantize_fp8(x, mode)
        x_hat = dequantize_fp8(q, scale, mode, dtype=torch.float32)
        rel_err[mode] = float((x_hat - x)[outside].norm() / x[outside].norm())
        flushed_to_zero[mode] = float(((x_hat == 0) & (x != 0))[outside].float().mean())
    # per-tensor: scale = 1e4/448 ~ 22, so the subnormal step (scale * 2^-9 ~ 0.044) is twice
    # the weights' std and most of them round to 0; block scales leave the other 15 blocks at
    # ordinary e4m3 accuracy. (A 100x outlier would not show this: e4m3 spans ~2^17.)
    assert flushed_to_zero["block_128"] == 0.0
    assert flushed_to_zero["per_tensor"] > 0.5
    assert rel_err["block_128"] < 2**-5
    assert rel_err["per_tensor"] > 10 * rel_err["block_128"], rel_err


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_tensor_gets_unit_scale_and_round_trips_to_zero(mode: QuantMode) -> None:
    x = torch.zeros(130, 70, dtype=torch.bfloat16)
    q, scale = quantize_fp8(x, mode)
    assert bool((scale == 1.0).all())
    assert bool((dequantize_fp8(q, scale, mode) == 0).all())


def test_zero_block_next_to_a_nonzero_block() -> None:
    x = torch.zeros(128, 256)
    x[:, 128:] = weight(128, 128).float()
    q, scale = quantize_fp8(x, "block_128")
    assert float(scale[0, 0]) == 1.0 and float(scale[0, 1]) == pytest.approx(
        float(x[:, 128:].abs().max()) / 448
    )
    x_hat = dequantize_fp8(q, scale, "block_128", dtype=torch.float32)
    assert bool((x_hat[:, :128] == 0).all())
    assert bool(((x_hat - x).abs() <= fp8_error_bound(x, scale, "block_128")).all())


def test_largest_value_maps_to_the_fp8_max() -> None:
    x = weight(64, 64).float()
    q, scale = quantize_fp8(x, "per_tensor")
    assert float(q.float().abs().max()) == 448.0
    assert float(scale) == pytest.approx(float(x.abs().max()) / 448)


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(torch.tensor([[1.0, float("nan")]]), "per_tensor")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]), "block_128")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.randn(2, 3, 4), "block_128")
    with pytest.raises(ValueError, match="floating"):
        quantize_fp8(torch.ones(2, 2, dtype=torch.int32), "per_tensor")
    with pytest.raises(ValueError, match="unknown FP8 mode"):
        quantize_fp8(torch.randn(2, 2), "per_channel")  # type: ignore[arg-type]
    q, scale = quantize_fp8(torch.randn(200, 200), "block_128")
    with pytest.raises(ValueError, match="block scale shape"):
        dequantize_fp8(q, scale[:1], "block_128")


@pytest.mark.parametrize("mode", MODES)
def test_fp8_bytes_with_scales_are_at_most_052_of_bf16_for_qwen2_linears(mode: QuantMode) -> None:
    bf16_bytes = fp8_bytes = 0
    for seed, (name, shape) in enumerate(qwen2_0_5b_layer_linears().items()):
        w = weight(*shape, seed=seed)
        assert should_quantize(name, w)
        q, scale = quantize_fp8(w, mode)
        bf16_bytes += w.numel() * w.element_size()
        fp8_bytes += q.numel() * q.element_size() + scale.numel() * scale.element_size()
    assert fp8_bytes <= 0.52 * bf16_bytes
    assert fp8_bytes / bf16_bytes > 0.5  # the scales are counted


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 64), True),
        ("model.layers.0.mlp.down_proj.weight", (64, 176), True),
        ("model.layers.0.mlp.experts.3.gate_proj.weight", (32, 64), True),
        ("model.layers.0.self_attn.q_proj.bias", (64,), False),
        ("model.embed_tokens.weight", (1000, 64), False),
        ("lm_head.weight", (1000, 64), False),
        ("model.layers.0.input_layernorm.weight", (64,), False),
        ("model.layers.0.self_attn.q_norm.weight", (16,), False),
        ("model.norm.weight", (64,), False),
        ("model.layers.0.mlp.gate.weight", (8, 64), False),  # MoE router
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), False),
    ],
)
def test_should_quantize_only_linear_weights(
    name: str, shape: tuple[int, ...], expected: bool
) -> None:
    assert should_quantize(name, torch.zeros(shape, dtype=torch.bfloat16)) is expected


def test_embeddings_are_quantized_only_on_request() -> None:
    embedding = torch.zeros(1000, 64, dtype=torch.bfloat16)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert should_quantize(name, embedding, embeddings=True)
    # norms and router gates stay in their dtype either way
    assert not should_quantize("model.norm.weight", torch.zeros(64), embeddings=True)
    router = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert not should_quantize("model.layers.0.mlp.gate.weight", router, embeddings=True)


def test_export_quantizes_embeddings_on_request() -> None:
    from relayrl.weightsync.sender import export_tensors

    tensors = {
        "model.embed_tokens.weight": torch.randn(256, 128),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128),
    }
    default, _ = export_tensors(tensors.items(), "fp8_block_128")
    assert default["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert default["model.layers.0.mlp.up_proj.weight"].dtype == FP8_DTYPE
    wire, metas = export_tensors(tensors.items(), "fp8_block_128", quantize_embeddings=True)
    assert wire["model.embed_tokens.weight"].dtype == FP8_DTYPE
    assert "model.embed_tokens.weight_scale_inv" in {m.name for m in metas}


def test_should_quantize_skips_non_float_and_already_fp8() -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    assert not should_quantize(name, torch.zeros(4, 4, dtype=torch.int64))
    assert not should_quantize(name, torch.zeros(4, 4, dtype=FP8_DTYPE))


@pytest.mark.parametrize("mode", MODES)
def test_quantized_stream_travels_through_buckets_and_dequantizes(mode: QuantMode) -> None:
    tensors = {
        "model.embed_tokens.weight": weight(100, 64, seed=1),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": weight(64, 64, seed=2),
        "model.layers.0.self_attn.q_proj.bias": weight(1, 64, seed=3).reshape(64),
        "model.layers.0.mlp.down_proj.weight": weight(64, 176, seed=4),
    }
    stream = list(quantize_named_tensors(tensors.items(), mode))
    specs = [spec for spec, _ in stream]
    q_spec = next(s for s in specs if s.name == "model.layers.0.self_attn.q_proj.weight")
    assert q_spec.dtype == "float8_e4m3fn"
    assert q_spec.quantization == f"fp8_{mode}"
    assert q_spec.scale_name == scale_name(q_spec.name, mode)
    suffix = "_scale" if mode == "per_tensor" else "_scale_inv"
    assert q_spec.scale_name == q_spec.name + suffix
    assert [s.name for s in specs][:4] == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        q_spec.scale_name,
    ]

    plan = plan_buckets(specs, 2048)
    sent = {spec.name: t for spec, t in stream}
    out = torch.empty(2048, dtype=torch.uint8)
    assembler = BucketAssembler(plan)
    received: dict[str, torch.Tensor] = {}
    for b in plan:
        received |= dict(assembler.feed(b.index, pack_bucket(b, sent, out)))
    assembler.finish()
    pieces = {p.name: p for b in plan for p in b.pieces}
    for name, original in tensors.items():
        piece = pieces[name]
        if piece.quantization == "none":
            assert torch.equal(received[name], original)
            continue
        x_hat = dequantize_fp8(received[name], received[piece.scale_name], mode)
        bound = fp8_error_bound(original, received[piece.scale_name], mode, torch.bfloat16)
        assert bool(((x_hat.float() - original.float()).abs() <= bound).all())
