"""Hugging Face (Qwen2 / Llama / Qwen3) <-> megatron-core GPTModel weights, per tensor-parallel
rank.

megatron-bridge does not install on CPU, so the mapping lives here. The conversions are pure
tensor functions (`hf_to_mcore`, `mcore_to_hf`: no process group, usable in tests and tools);
`export_hf_tensors` adds the tensor-parallel gather for a live model, for checkpoint export and
for the weight-sync service.

megatron's local layer spec names and layouts (TP = tensor-parallel size, ng = KV heads,
nh = query heads, hd = head size, r = TP rank):

    embedding.word_embeddings.weight                   [V/TP, H]     rows r*V/TP...
    decoder.layers.{i}.input_layernorm.weight          [H]           replicated
    decoder.layers.{i}.self_attention.linear_qkv.weight [ng/TP*(nh/ng+2)*hd, H]
        per KV group g of rank r: [q heads of g (nh/ng*hd rows) | k_g (hd) | v_g (hd)]
    decoder.layers.{i}.self_attention.linear_qkv.bias   same rows (Qwen2)
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight [hd]  replicated (Qwen3)
    decoder.layers.{i}.self_attention.linear_proj.weight [H, nh/TP*hd] columns of rank r
    decoder.layers.{i}.pre_mlp_layernorm.weight        [H]
    decoder.layers.{i}.mlp.linear_fc1.weight           [2*I/TP, H] = [gate_r; up_r]
    decoder.layers.{i}.mlp.linear_fc2.weight           [H, I/TP]
    decoder.final_layernorm.weight                     [H]
    output_layer.weight                                [V/TP, H]     only when not tied

With Transformer-Engine-style fused norms the two layer norms are named
`self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight`;
`mcore_to_hf` reads either naming, `hf_to_mcore(..., fused_layer_norm=True)` writes the TE one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.models.families import TRAINABLE_MODEL_TYPES

SUPPORTED_MODEL_TYPES = TRAINABLE_MODEL_TYPES

# Per-layer names, relative to `decoder.layers.{i}.` / `model.layers.{i}.`.
_MC_INPUT_NORM = "input_layernorm.weight"
_MC_INPUT_NORM_TE = "self_attention.linear_qkv.layer_norm_weight"
_MC_MLP_NORM = "pre_mlp_layernorm.weight"
_MC_MLP_NORM_TE = "mlp.linear_fc1.layer_norm_weight"
_MC_QKV_W = "self_attention.linear_qkv.weight"
_MC_QKV_B = "self_attention.linear_qkv.bias"
_MC_PROJ = "self_attention.linear_proj.weight"
_MC_Q_NORM = "self_attention.q_layernorm.weight"
_MC_K_NORM = "self_attention.k_layernorm.weight"
_MC_FC1 = "mlp.linear_fc1.weight"
_MC_FC2 = "mlp.linear_fc2.weight"
_MC_EMBEDDING = "embedding.word_embeddings.weight"
_MC_FINAL_NORM = "decoder.final_layernorm.weight"
_MC_OUTPUT = "output_layer.weight"

_HF_EMBEDDING = "model.embed_tokens.weight"
_HF_FINAL_NORM = "model.norm.weight"
_HF_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (`rope_type: llama3` in config.json): wavelengths
    longer than the original context divided by `factor`, shorter than its 1/high_freq_factor
    kept, those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_rope_parameters(cls, rope: Mapping[str, Any]) -> Llama3RopeScaling:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if key not in rope]
        if missing:
            raise ValueError(f"rope_type 'llama3' needs {', '.join(missing)} in rope_parameters")
        scaling = cls(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
        if not (scaling.factor >= 1.0 and 0 < scaling.low_freq_factor < scaling.high_freq_factor):
            raise ValueError(
                f"rope_parameters of rope_type 'llama3' are out of range: factor >= 1 and "
                f"0 < low_freq_factor < high_freq_factor, got {dict(rope)}"
            )
        return scaling


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Qwen2/Llama decoder, as megatron needs it to build and map the model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys before RoPE (Qwen3)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads {self.num_kv_heads} must divide "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def check_tensor_parallel(self, tp_size: int) -> None:
        """ValueError unless every sharded dimension splits evenly over `tp_size` ranks."""
        for what, size in (
            ("vocab_size", self.vocab_size),
            ("num_kv_heads", self.num_kv_heads),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if tp_size < 1 or size % tp_size:
                raise ValueError(
                    f"{what} {size} does not split over tensor-parallel size {tp_size}; "
                    "choose a tensor-parallel size that divides it"
                )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """From a parsed HF `config.json`. ValueError names what is unsupported."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; the trainer maps "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("use_sliding_window") or any(
            t != "full_attention" for t in config.get("layer_types") or ()
        ):
            raise ValueError("sliding-window attention is not supported; use full attention")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        if model_type in ("llama", "qwen3") and config.get("attention_bias"):
            raise ValueError(f"{model_type} attention_bias (bias on o_proj too) is not supported")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (default RoPE or llama3 scaling)"
            )
        scaling = Llama3RopeScaling.from_rope_parameters(rope) if rope_type == "llama3" else None
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config["rms_norm_eps"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(config["max_position_embeddings"]),
            rope_scaling=scaling,
        )

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies (fp32, one per pair of head dimensions), scaled as the
        config says: what transformers computes for the same config."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        context = scaling.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(
            wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq
        )
        smooth = (context / wavelength - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        between = (wavelength >= context / scaling.high_freq_factor) & (
            wavelength <= context / scaling.low_freq_factor
        )
        return torch.where(between, blended, scaled)

    @classmethod
    def from_hf_dir(cls, path: Path) -> ModelSpec:
        """From `path/config.json` of a Hugging Face model folder."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file} does not exist; pass a Hugging Face model folder")
        return cls.from_hf_config(json.loads(config_file.read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------- HF -> mcore


def _shard(tensor: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.chunk(tensor, tp_size, dim=dim)[tp_rank].contiguous().clone()


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """HF q/k/v (weights [n*hd, H] or biases [n*hd]) -> this rank's fused QKV rows."""
    ng, hd, per_group = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    rest = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(ng, per_group * hd, *rest),
            k.reshape(ng, hd, *rest),
            v.reshape(ng, hd, *rest),
        ],
        dim=1,
    )
    groups_per_rank = ng // tp_size
    mine = fused[tp_rank * groups_per_rank : (tp_rank + 1) * groups_per_rank]
    return mine.reshape(-1, *rest).contiguous().clone()


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    tp_rank: int,
    tp_size: int,
    *,
    fused_layer_norm: bool = False,
) -> dict[str, torch.Tensor]:
    """The megatron state dict of tensor-parallel rank `tp_rank` out of `tp_size`, from full
    HF tensors. Every returned tensor is a fresh copy (loading it never aliases `hf`).
    ValueError when an HF tensor the spec needs is missing; extra ones (a tied model's saved
    `lm_head.weight`) are ignored."""
    spec.check_tensor_parallel(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    missing = [name for name in hf_tensor_names(spec) if name not in hf]
    if missing:
        raise ValueError(f"the HF weights lack {len(missing)} tensors of the spec: {missing[:5]}")
    out: dict[str, torch.Tensor] = {
        _MC_EMBEDDING: _shard(hf[_HF_EMBEDDING], 0, tp_rank, tp_size),
        _MC_FINAL_NORM: hf[_HF_FINAL_NORM].clone(),
    }
    if not spec.tie_word_embeddings:
        out[_MC_OUTPUT] = _shard(hf[_HF_LM_HEAD], 0, tp_rank, tp_size)
    input_norm = _MC_INPUT_NORM_TE if fused_layer_norm else _MC_INPUT_NORM
    mlp_norm = _MC_MLP_NORM_TE if fused_layer_norm else _MC_MLP_NORM
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[m + input_norm] = hf[h + "input_layernorm.weight"].clone()
        out[m + _MC_QKV_W] = _fuse_qkv(
            *(hf[f"{attn}{p}_proj.weight"] for p in "qkv"), spec, tp_rank, tp_size
        )
        if spec.qkv_bias:
            out[m + _MC_QKV_B] = _fuse_qkv(
                *(hf[f"{attn}{p}_proj.bias"] for p in "qkv"), spec, tp_rank, tp_size
            )
        if spec.qk_norm:
            out[m + _MC_Q_NORM] = hf[attn + "q_norm.weight"].clone()
            out[m + _MC_K_NORM] = hf[attn + "k_norm.weight"].clone()
        out[m + _MC_PROJ] = _shard(hf[attn + "o_proj.weight"], 1, tp_rank, tp_size)
        out[m + mlp_norm] = hf[h + "post_attention_layernorm.weight"].clone()
        out[m + _MC_FC1] = torch.cat(
            [
                _shard(hf[h + "mlp.gate_proj.weight"], 0, tp_rank, tp_size),
                _shard(hf[h + "mlp.up_proj.weight"], 0, tp_rank, tp_size),
            ]
        )
        out[m + _MC_FC2] = _shard(hf[h + "mlp.down_proj.weight"], 1, tp_rank, tp_size)
    return out


# ---------------------------------------------------------------------------- mcore -> HF
#
# The export is organised in units (embedding, each layer, final norm, output layer): a unit's
# megatron tensors from every TP rank go in, its HF tensors come out. `mcore_to_hf` runs the
# units over full state dicts; `export_hf_tensors` gathers one unit at a time over the
# tensor-parallel group, so a live export never holds more than one layer twice.


@dataclass(frozen=True)
class _Unit:
    """megatron names of one unit (each with its TP split dim, None if replicated) and the
    function that turns the per-rank tensors into HF (name, tensor) pairs."""

    mcore_names: tuple[tuple[str, int | None], ...]
    to_hf: Callable[[list[dict[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]


def _unfuse_qkv(
    shards: list[torch.Tensor], spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd, per_group = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    fused = torch.cat(shards, dim=0)
    rest = fused.shape[1:]
    grouped = fused.reshape(ng, (per_group + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return (
        q.reshape(ng * per_group * hd, *rest).contiguous(),
        k.reshape(ng * hd, *rest).contiguous(),
        v.reshape(ng * hd, *rest).contiguous(),
    )


def _layer_unit(i: int, spec: ModelSpec, fused_layer_norm: bool) -> _Unit:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    input_norm = m + (_MC_INPUT_NORM_TE if fused_layer_norm else _MC_INPUT_NORM)
    mlp_norm = m + (_MC_MLP_NORM_TE if fused_layer_norm else _MC_MLP_NORM)
    names: list[tuple[str, int | None]] = [(input_norm, None), (m + _MC_QKV_W, 0)]
    if spec.qkv_bias:
        names.append((m + _MC_QKV_B, 0))
    if spec.qk_norm:
        names += [(m + _MC_Q_NORM, None), (m + _MC_K_NORM, None)]
    names += [(m + _MC_PROJ, 1), (mlp_norm, None), (m + _MC_FC1, 0), (m + _MC_FC2, 1)]

    def to_hf(ranks: list[dict[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        attn = h + "self_attn."
        q_w, k_w, v_w = _unfuse_qkv([r[m + _MC_QKV_W] for r in ranks], spec)
        out = [
            (h + "input_layernorm.weight", ranks[0][input_norm]),
            (attn + "q_proj.weight", q_w),
            (attn + "k_proj.weight", k_w),
            (attn + "v_proj.weight", v_w),
        ]
        if spec.qkv_bias:
            q_b, k_b, v_b = _unfuse_qkv([r[m + _MC_QKV_B] for r in ranks], spec)
            out += [(attn + "q_proj.bias", q_b), (attn + "k_proj.bias", k_b)]
            out += [(attn + "v_proj.bias", v_b)]
        if spec.qk_norm:
            out += [(attn + "q_norm.weight", ranks[0][m + _MC_Q_NORM])]
            out += [(attn + "k_norm.weight", ranks[0][m + _MC_K_NORM])]
        gate_up = [torch.chunk(r[m + _MC_FC1], 2, dim=0) for r in ranks]
        out += [
            (attn + "o_proj.weight", torch.cat([r[m + _MC_PROJ] for r in ranks], dim=1)),
            (h + "post_attention_layernorm.weight", ranks[0][mlp_norm]),
            (h + "mlp.gate_proj.weight", torch.cat([g for g, _ in gate_up], dim=0)),
            (h + "mlp.up_proj.weight", torch.cat([u for _, u in gate_up], dim=0)),
            (h + "mlp.down_proj.weight", torch.cat([r[m + _MC_FC2] for r in ranks], dim=1)),
        ]
        return out

    return _Unit(tuple(names), to_hf)


def _single_unit(mcore_name: str, split_dim: int | None, hf_name: str) -> _Unit:
    def to_hf(ranks: list[dict[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if split_dim is None:
            return [(hf_name, ranks[0][mcore_name])]
        return [(hf_name, torch.cat([r[mcore_name] for r in ranks], dim=split_dim))]

    return _Unit(((mcore_name, split_dim),), to_hf)


def _export_units(spec: ModelSpec, fused_layer_norm: bool) -> list[_Unit]:
    """The units in HF order: embedding, layers 0..L-1, final norm, lm_head (untied only)."""
    units = [_single_unit(_MC_EMBEDDING, 0, _HF_EMBEDDING)]
    units += [_layer_unit(i, spec, fused_layer_norm) for i in range(spec.num_layers)]
    units.append(_single_unit(_MC_FINAL_NORM, None, _HF_FINAL_NORM))
    if not spec.tie_word_embeddings:
        units.append(_single_unit(_MC_OUTPUT, 0, _HF_LM_HEAD))
    return units


def _uses_fused_layer_norm(names: Mapping[str, Any] | set[str]) -> bool:
    return any(name.endswith(_MC_INPUT_NORM_TE) for name in names)


def hf_tensor_names(spec: ModelSpec) -> list[str]:
    """Every HF tensor name of the model, in the order the export yields them. A tied model has
    no `lm_head.weight` (as in the HF safetensors file)."""
    names: list[str] = [_HF_EMBEDDING]
    for i in range(spec.num_layers):
        h = f"model.layers.{i}."
        names.append(h + "input_layernorm.weight")
        names += [f"{h}self_attn.{p}_proj.weight" for p in "qkv"]
        if spec.qkv_bias:
            names += [f"{h}self_attn.{p}_proj.bias" for p in "qkv"]
        if spec.qk_norm:
            names += [h + "self_attn.q_norm.weight", h + "self_attn.k_norm.weight"]
        names += [h + "self_attn.o_proj.weight", h + "post_attention_layernorm.weight"]
        names += [f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names.append(_HF_FINAL_NORM)
    if not spec.tie_word_embeddings:
        names.append(_HF_LM_HEAD)
    return names


def mcore_to_hf(
    state_by_tp_rank: list[dict[str, torch.Tensor]], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """Full HF tensors from the megatron state dicts of every tensor-parallel rank (index =
    rank). Reads local-spec or TE-style norm names; ignores `_extra_state` entries; ValueError
    on any other tensor it does not map, so a model change cannot be exported silently wrong."""
    if not state_by_tp_rank:
        raise ValueError("state_by_tp_rank is empty; pass one state dict per tensor-parallel rank")
    spec.check_tensor_parallel(len(state_by_tp_rank))
    fused = _uses_fused_layer_norm(state_by_tp_rank[0].keys())
    units = _export_units(spec, fused)
    expected = {name for unit in units for name, _ in unit.mcore_names}
    for rank, state in enumerate(state_by_tp_rank):
        extra = {n for n in state if n not in expected and not n.endswith("_extra_state")}
        if extra:
            raise ValueError(f"tensor-parallel rank {rank} has unmapped tensors: {sorted(extra)}")
    out: dict[str, torch.Tensor] = {}
    for unit in units:
        out.update(unit.to_hf(state_by_tp_rank))
    return out


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # megatron's DDP (and Float16Module) keep the GPTModel in `.module`.
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@torch.no_grad()
def export_hf_tensors(
    model: torch.nn.Module, spec: ModelSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every weight of a live megatron GPTModel (DDP-wrapped
    or not), gathered over the tensor-parallel group, in `hf_tensor_names(spec)` order.

    Collective: every rank of the tensor-parallel group must drain the iterator (each rank gets
    the same full tensors). The tensors are fresh copies, safe to keep after the next optimizer
    step. Pipeline parallelism is not supported (ValueError).
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("export_hf_tensors needs pipeline-parallel size 1")
    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(_unwrap(model).named_parameters())
    for unit in _export_units(spec, _uses_fused_layer_norm(params.keys())):
        ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        for name, split_dim in unit.mcore_names:
            local = params[name].detach()
            if split_dim is None or tp_size == 1:
                for r in ranks:
                    r[name] = local
                continue
            gathered = [torch.empty_like(local) for _ in range(tp_size)]
            torch.distributed.all_gather(gathered, local.contiguous(), group=group)
            for r, tensor in zip(ranks, gathered, strict=True):
                r[name] = tensor
        for hf_name, tensor in unit.to_hf(ranks):
            yield hf_name, tensor.detach().clone()
