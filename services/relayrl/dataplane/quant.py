"""FP8 (e4m3) quantisation of weights for transport to FP8 inference engines.

Halving the bytes of the linear weights halves the time the data plane spends on them, and an
engine serving FP8 would quantise them anyway. The price is precision (docs/weightsync.md#fp8):
an engine running FP8 weights is a *different* policy from the bf16 one the trainer holds, so
its logprobs must not be used as the behaviour policy's denominators without correction.

Format: ``torch.float8_e4m3fn`` — 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
infinities, largest finite value 448, smallest normal 2^-6, subnormal spacing 2^-9.

Scale convention (one rule for both modes): the sender stores ``q = round(x / scale)`` and the
scale tensor holds ``scale = amax / 448`` in float32, so the receiver reconstructs
``x ≈ q * scale`` by *multiplying*. An all-zero tensor or block gets ``scale = 1`` (its values
quantise to 0 either way; a zero scale would divide by zero).

Names the receiver sees, following the checkpoints vLLM already loads:
- ``"per_tensor"``: ``<name>_scale`` (e.g. ``model.layers.0.mlp.down_proj.weight_scale``), a
  0-d float32 tensor — the compressed-tensors / vLLM ``weight_scale`` convention;
- ``"block_128"``: ``<name>_scale_inv`` with shape ``[ceil(rows/128), ceil(cols/128)]`` — the
  DeepSeek-V3 / Qwen3-FP8 ``weight_scale_inv`` convention (despite the name, it is multiplied:
  it is the inverse of the quantisation factor ``448 / amax``).

Which tensors: by default only 2-D weights of linear layers (:func:`should_quantize`), as
vLLM's own FP8 checkpoints do. Embeddings and ``lm_head`` are lookups/logit projections whose
errors land directly on token probabilities, norms and biases are tiny 1-D vectors whose bytes
do not matter, and MoE router gates decide discrete expert choices that a rounding error can
flip; all of those go in their own dtype. ``embeddings=True`` quantises embeddings and
``lm_head`` too, for FP8 used purely as wire compression (the receiver dequantises): the
embedding of a small-vocabulary-heavy model is a large share of its bytes (6 % of a 1 GiB
Qwen2-shaped model, 14 % of Qwen2.5-7B), and its error per element is the same e4m3 bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from relayrl.dataplane.plan import TensorSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
BLOCK_SIZE = 128

QuantMode = Literal["per_tensor", "block_128"]
QUANTIZATION_BY_MODE: dict[str, str] = {
    "per_tensor": "fp8_per_tensor",
    "block_128": "fp8_block_128",
}
"""Mode -> the ``quantization`` string of :class:`~relayrl.dataplane.plan.Piece`."""

_SKIP_NAME_PARTS = ("norm", "mlp.gate.", "shared_expert_gate")
EMBEDDING_NAME_PARTS = ("embed", "lm_head")
"""Name parts of embeddings and lm_head: FP8 engines keep these in bf16."""


def should_quantize(name: str, tensor: torch.Tensor, *, embeddings: bool = False) -> bool:
    """True for the 2-D floating weight of a linear layer, and with `embeddings` for
    embeddings and ``lm_head``; never for norms, biases or MoE router gates (see the module
    docstring for why)."""
    if tensor.dim() != 2 or not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE:
        return False
    if not name.endswith(".weight"):
        return False
    if not embeddings and any(part in name for part in EMBEDDING_NAME_PARTS):
        return False
    return not any(part in name for part in _SKIP_NAME_PARTS)


def scale_name(name: str, mode: QuantMode) -> str:
    """The name under which the receiver finds ``name``'s scales."""
    _check_mode(mode)
    return f"{name}_scale" if mode == "per_tensor" else f"{name}_scale_inv"


def scale_shape(shape: tuple[int, ...], mode: QuantMode) -> tuple[int, ...]:
    """Shape of the scale tensor for a weight of ``shape`` (receivers preallocate with it)."""
    _check_mode(mode)
    if mode == "per_tensor":
        return ()
    if len(shape) != 2:
        raise ValueError(f"block_128 quantises 2-D weights only, got shape {shape}")
    return (math.ceil(shape[0] / BLOCK_SIZE), math.ceil(shape[1] / BLOCK_SIZE))


def _check_mode(mode: str) -> None:
    if mode not in QUANTIZATION_BY_MODE:
        raise ValueError(f"unknown FP8 mode {mode!r}; use 'per_tensor' or 'block_128'")


def _safe_scale(amax: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantise a tensor holding inf or NaN; the weights are broken")
    scale = amax / FP8_E4M3_MAX
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # x / (amax / 448) can land a hair above 448 in float32; clamp instead of relying on how
    # the cast treats out-of-range values.
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def _pad_to_blocks(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    pad_rows, pad_cols = (-rows) % BLOCK_SIZE, (-cols) % BLOCK_SIZE
    if pad_rows or pad_cols:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    return x


def _expand_block_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    full = scale.repeat_interleave(BLOCK_SIZE, dim=0).repeat_interleave(BLOCK_SIZE, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_fp8(t: torch.Tensor, mode: QuantMode) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``t`` to e4m3; return ``(q, scale)`` with ``t ≈ q.float() * scale``.

    ``"per_tensor"``: one 0-d float32 scale. ``"block_128"``: one scale per 128x128 tile of a
    2-D ``t``, shape ``[ceil(rows/128), ceil(cols/128)]``; ragged edge tiles are padded with
    zeros logically (the padding never reaches ``q``). Block scales confine an outlier's damage
    to its own tile, where a per-tensor scale pushes every small value into the subnormals.
    """
    _check_mode(mode)
    if not t.is_floating_point():
        raise ValueError(f"FP8 quantisation needs a floating tensor, got {t.dtype}")
    x = t.detach().float()
    if mode == "per_tensor":
        amax = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
        scale = _safe_scale(amax)
        return _to_fp8(x / scale), scale
    if x.dim() != 2:
        raise ValueError(f"block_128 quantises 2-D weights only, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    padded = _pad_to_blocks(x)
    num_row_blocks, num_col_blocks = padded.shape[0] // BLOCK_SIZE, padded.shape[1] // BLOCK_SIZE
    tiles = padded.view(num_row_blocks, BLOCK_SIZE, num_col_blocks, BLOCK_SIZE)
    scale = _safe_scale(tiles.abs().amax(dim=(1, 3)))
    q = _to_fp8(tiles / scale[:, None, :, None]).view(padded.shape)[:rows, :cols]
    return q.contiguous(), scale.contiguous()


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, mode: QuantMode, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q * scale`` (block scales broadcast over tiles)."""
    _check_mode(mode)
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"expected {FP8_DTYPE}, got {q.dtype}")
    x = q.float()
    if mode == "per_tensor":
        return (x * scale.float()).to(dtype)
    expected = scale_shape(tuple(q.shape), mode)
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scale shape {tuple(scale.shape)} != {expected} for {q.shape}")
    return (x * _expand_block_scale(scale.float(), (q.shape[0], q.shape[1]))).to(dtype)


_REL_ROUNDING = 2.0**-4  # half an e4m3 ulp relative to the value: 3 mantissa bits
_SUBNORMAL_SPACING = 2.0**-9  # e4m3 subnormal step, in units of the scale
_FLOAT32_SLACK = 2.0**-20  # a few float32 roundings in x / scale and q * scale


def fp8_error_bound(
    reference: torch.Tensor,
    scale: torch.Tensor,
    mode: QuantMode,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-element bound on ``|dequantize_fp8(quantize_fp8(x)) - x|``.

    Derivation. Let ``y = x / s`` (``s`` the element's scale), so ``|y| <= 448`` and
    ``x_hat = s * round_e4m3(y)``.
    - Normal range (``|y| >= 2^-6``): with ``2^e <= |y| < 2^(e+1)``, e4m3 values are spaced
      ``2^(e-3)`` apart (3 mantissa bits); round-to-nearest is off by at most half of that,
      ``2^(e-4) <= 2^-4 * |y|``. The top binade ends exactly at 448, so the clamp adds nothing.
    - Subnormal range (``|y| < 2^-6``): values are spaced ``2^-9`` apart, error ``<= 2^-10``;
      we allow the full spacing ``2^-9`` (it also covers the normal/subnormal boundary).
    Multiplying back by ``s``: ``|x_hat - x| <= 2^-4 * |x| + s * 2^-9``. Casting the result to
    ``out_dtype`` adds at most its unit roundoff ``u`` times ``|x_hat| <= (1 + 2^-4)|x| + ...``,
    and the float32 arithmetic a relative ``2^-20`` at most. Hence

        bound = (2^-4 + u * (1 + 2^-4) + 2^-20) * |x| + s * 2^-9 * (1 + u).
    """
    _check_mode(mode)
    x = reference.detach().float()
    s = scale.float()
    if mode == "block_128":
        s = _expand_block_scale(s, (x.shape[0], x.shape[1]))
    unit_roundoff = torch.finfo(out_dtype).eps / 2
    relative = _REL_ROUNDING + unit_roundoff * (1 + _REL_ROUNDING) + _FLOAT32_SLACK
    return relative * x.abs() + s * _SUBNORMAL_SPACING * (1 + unit_roundoff)


def quantize_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], mode: QuantMode
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Turn an export stream into what the plan carries: FP8 weights, each followed by its
    float32 scale tensor; tensors :func:`should_quantize` rejects pass through unchanged."""
    _check_mode(mode)
    for name, t in named_tensors:
        if not should_quantize(name, t):
            yield TensorSpec.from_tensor(name, t), t
            continue
        q, scale = quantize_fp8(t, mode)
        s_name = scale_name(name, mode)
        yield (
            TensorSpec.from_tensor(
                name, q, quantization=QUANTIZATION_BY_MODE[mode], scale_name=s_name
            ),
            q,
        )
        yield TensorSpec.from_tensor(s_name, scale), scale
