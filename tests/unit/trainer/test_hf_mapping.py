"""The HF <-> megatron weight mapping on random tensors: exact round trips per TP size, the
fused-QKV / gate-up layouts megatron expects, and the configs the trainer refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relayrl.trainer.hf_mapping import (
    ModelSpec,
    hf_tensor_names,
    hf_to_mcore,
    mcore_to_hf,
)

SPEC = ModelSpec(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=4,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qkv_bias=True,
    max_position_embeddings=128,
)


def random_hf(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with every HF name and shape of `spec`."""
    generator = torch.Generator().manual_seed(seed)
    h, hd = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    shapes = {
        "q_proj.weight": (q_rows, h),
        "k_proj.weight": (kv_rows, h),
        "v_proj.weight": (kv_rows, h),
        "q_proj.bias": (q_rows,),
        "k_proj.bias": (kv_rows,),
        "v_proj.bias": (kv_rows,),
        "o_proj.weight": (h, q_rows),
        "gate_proj.weight": (spec.intermediate_size, h),
        "up_proj.weight": (spec.intermediate_size, h),
        "down_proj.weight": (h, spec.intermediate_size),
        "q_norm.weight": (hd,),
        "k_norm.weight": (hd,),
        "layernorm.weight": (h,),
        "norm.weight": (h,),
        "embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
    }
    out = {}
    for name in hf_tensor_names(spec):
        suffix = next(s for s in shapes if name.endswith(s))
        out[name] = torch.randn(shapes[suffix], generator=generator)
    return out


SPECS = {
    "gqa_bias_tied": SPEC,
    "mha_nobias_untied": dataclasses.replace(
        SPEC, num_kv_heads=8, qkv_bias=False, tie_word_embeddings=False
    ),
    "gqa_untied_wide_heads": dataclasses.replace(
        SPEC, num_kv_heads=4, head_dim=8, tie_word_embeddings=False
    ),
    "qwen3_qk_norm": dataclasses.replace(SPEC, qkv_bias=False, qk_norm=True, head_dim=8),
}


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("tp_size", [1, 2])
def test_round_trip_is_exact(spec_name: str, tp_size: int) -> None:
    spec = SPECS[spec_name]
    hf = random_hf(spec)
    shards = [hf_to_mcore(hf, spec, rank, tp_size) for rank in range(tp_size)]
    back = mcore_to_hf(shards, spec)
    assert list(back) == hf_tensor_names(spec)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_shard_shapes_and_names_at_tp2() -> None:
    shard = hf_to_mcore(random_hf(SPEC), SPEC, 1, 2)
    groups_per_rank, per_group, hd = 1, 4, SPEC.head_dim
    prefix = "decoder.layers.0."
    assert shard["embedding.word_embeddings.weight"].shape == (32, 32)
    assert shard[prefix + "self_attention.linear_qkv.weight"].shape == (
        groups_per_rank * (per_group + 2) * hd,
        32,
    )
    assert shard[prefix + "self_attention.linear_qkv.bias"].shape == (24,)
    assert shard[prefix + "self_attention.linear_proj.weight"].shape == (32, 16)
    assert shard[prefix + "mlp.linear_fc1.weight"].shape == (48, 32)
    assert shard[prefix + "mlp.linear_fc2.weight"].shape == (32, 24)
    assert shard[prefix + "input_layernorm.weight"].shape == (32,)
    assert shard[prefix + "pre_mlp_layernorm.weight"].shape == (32,)
    assert "output_layer.weight" not in shard  # tied


def test_fused_qkv_is_grouped_per_kv_head_and_split_per_rank() -> None:
    hf = random_hf(SPEC)
    hd, per_group = SPEC.head_dim, SPEC.heads_per_group
    attn = "model.layers.1.self_attn."
    q, k, v = (hf[f"{attn}{p}_proj.weight"] for p in "qkv")
    # TP 2, rank 1 holds KV group 1: its 4 query heads (4..7), then k head 1, then v head 1.
    qkv = hf_to_mcore(hf, SPEC, 1, 2)["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv[: per_group * hd], q[per_group * hd : 2 * per_group * hd])
    assert torch.equal(qkv[per_group * hd : (per_group + 1) * hd], k[hd : 2 * hd])
    assert torch.equal(qkv[(per_group + 1) * hd :], v[hd : 2 * hd])


def test_fc1_is_gate_then_up_of_this_rank() -> None:
    hf = random_hf(SPEC)
    fc1 = hf_to_mcore(hf, SPEC, 1, 2)["decoder.layers.0.mlp.linear_fc1.weight"]
    half = SPEC.intermediate_size // 2
    assert torch.equal(fc1[:half], hf["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], hf["model.layers.0.mlp.up_proj.weight"][half:])


def test_te_style_fused_norm_names_round_trip() -> None:
    hf = random_hf(SPEC)
    shards = [hf_to_mcore(hf, SPEC, rank, 2, fused_layer_norm=True) for rank in range(2)]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shards[0]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shards[0]
    assert "decoder.layers.0.input_layernorm.weight" not in shards[0]
    back = mcore_to_hf(shards, SPEC)
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_conversions_copy_rather_than_alias() -> None:
    hf = random_hf(SPEC)
    shard = hf_to_mcore(hf, SPEC, 0, 1)
    shard["decoder.final_layernorm.weight"].add_(1.0)
    assert not torch.equal(shard["decoder.final_layernorm.weight"], hf["model.norm.weight"])


def test_unmapped_tensor_is_refused() -> None:
    shard = hf_to_mcore(random_hf(SPEC), SPEC, 0, 1)
    shard["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(4)
    with pytest.raises(ValueError, match="unmapped"):
        mcore_to_hf([shard], SPEC)


def test_tensor_parallel_size_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="num_kv_heads 2 does not split"):
        hf_to_mcore(random_hf(SPEC), SPEC, 0, 4)


QWEN2_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "layer_types": ["full_attention"] * 3,
}


def test_spec_from_qwen2_and_llama_configs() -> None:
    spec = ModelSpec.from_hf_config(QWEN2_CONFIG)
    assert spec.head_dim == 32 and spec.qkv_bias and spec.tie_word_embeddings
    assert spec.rope_theta == 1_000_000.0 and spec.num_kv_heads == 2
    llama = {
        **QWEN2_CONFIG,
        "model_type": "llama",
        "rope_parameters": None,
        "rope_theta": 500_000.0,
        "head_dim": 64,
    }
    spec = ModelSpec.from_hf_config(llama)
    assert not spec.qkv_bias and spec.head_dim == 64 and spec.rope_theta == 500_000.0
    assert not spec.qk_norm and spec.rope_scaling is None
    spec = ModelSpec.from_hf_config({**QWEN2_CONFIG, "model_type": "qwen3", "head_dim": 128})
    assert spec.qk_norm and not spec.qkv_bias and spec.head_dim == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gemma2"}, "model_type"),
        ({"model_type": "qwen3", "attention_bias": True}, "qwen3 attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config({**QWEN2_CONFIG, **change})


def test_missing_hf_tensor_is_refused_by_name() -> None:
    hf = random_hf(SPEC)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_mcore(hf, SPEC, 0, 1)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "rope", [LLAMA3_ROPE, {**LLAMA3_ROPE, "factor": 8.0, "high_freq_factor": 2.0}]
)
def test_rope_frequencies_equal_transformers_with_and_without_llama3_scaling(
    rope: dict[str, float],
) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {**QWEN2_CONFIG, "model_type": "llama", "head_dim": 64, "rope_parameters": rope}
    spec = ModelSpec.from_hf_config(config)
    hf = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, device=torch.device("cpu"))
    assert torch.allclose(spec.rope_inv_freq(), expected.float(), rtol=1e-6, atol=0)
    # the scaling changes the long wavelengths only
    plain = dataclasses.replace(spec, rope_scaling=None).rope_inv_freq()
    assert torch.equal(spec.rope_inv_freq()[:4], plain[:4])
    assert torch.allclose(spec.rope_inv_freq()[-1], plain[-1] / rope["factor"])


def test_llama3_rope_without_its_parameters_is_refused() -> None:
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}
    with pytest.raises(ValueError, match="needs low_freq_factor"):
        ModelSpec.from_hf_config({**QWEN2_CONFIG, "model_type": "llama", "rope_parameters": rope})
