"""How a receiver turns buckets back into the tensors an engine loads: FP8 dequantised for a
bf16 engine, passed on with its scales for an FP8 engine (embeddings excepted), a format
mismatch refused. The data planes themselves are in tests/integration/weightsync."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import torch

from relayrl.dataplane.plan import pack_bucket, plan_buckets
from relayrl.dataplane.quant import FP8_DTYPE, dequantize_fp8
from relayrl.dataplane.receiver import ReceiveError, _tensors
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.coordinator import tensor_spec
from relayrl.weightsync.sender import export_tensors

BUCKET = 64 * 1024
MODEL = {
    "model.embed_tokens.weight": torch.randn(256, 128),
    "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128),
    "model.norm.weight": torch.randn(128),
}


def received(mode: str, engine_fp8: str | None) -> dict[str, torch.Tensor]:
    wire, metas = export_tensors(MODEL.items(), f"fp8_{mode}", quantize_embeddings=True)
    layouts = plan_buckets([tensor_spec(m) for m in metas], BUCKET)
    plan = pb.BucketPlan(
        buckets=[
            pb.Bucket(
                index=b.index, size_bytes=b.size_bytes, tensors=[p.to_proto() for p in b.pieces]
            )
            for b in layouts
        ]
    )
    out = torch.empty(BUCKET, dtype=torch.uint8)

    def buckets() -> Iterator[tuple[int, torch.Tensor, str]]:
        for b in layouts:
            data = pack_bucket(b, wire, out)
            yield b.index, data, hashlib.sha256(data.numpy()).hexdigest()

    digests: list[str] = []
    tensors = dict(_tensors(plan, layouts, buckets(), torch.bfloat16, digests, engine_fp8))
    assert len(digests) == len(layouts)
    return tensors


@pytest.mark.parametrize("mode", ["per_tensor", "block_128"])
def test_a_bf16_engine_gets_every_weight_dequantized(mode: str) -> None:
    tensors = received(mode, None)
    assert sorted(tensors) == sorted(MODEL)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    up = tensors["model.layers.0.mlp.up_proj.weight"].float()
    assert torch.allclose(up, MODEL["model.layers.0.mlp.up_proj.weight"], rtol=0.07, atol=1e-2)


def test_an_fp8_engine_gets_fp8_weights_with_their_scales_and_bf16_embeddings() -> None:
    tensors = received("block_128", "block_128")
    name = "model.layers.0.mlp.up_proj.weight"
    assert tensors[name].dtype == FP8_DTYPE
    scale = tensors[f"{name}_scale_inv"]
    assert scale.shape == (2, 1)
    restored = dequantize_fp8(tensors[name], scale, "block_128", torch.float32)
    assert torch.allclose(restored, MODEL[name], rtol=0.07, atol=1e-2)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # kept bf16 by vLLM
    assert "model.embed_tokens.weight_scale_inv" not in tensors


def test_an_fp8_engine_refuses_another_fp8_format() -> None:
    with pytest.raises(ReceiveError, match="publish with quantization fp8_block_128"):
        received("per_tensor", "block_128")
