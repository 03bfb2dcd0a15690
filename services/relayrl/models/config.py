"""The tiny model's sizes and seeds (`TinyModelConfig`): pydantic only, so a command line can
check them before it imports torch."""

from __future__ import annotations

from pydantic import Field, model_validator

from relayrl.core.config import StrictModel
from relayrl.models.tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE

# Head sizes vLLM's CPU attention backend has kernels for (CPUAttentionBackend, vLLM 0.32).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class TinyModelConfig(StrictModel):
    """Sizes and seeds of the tiny model; the defaults give about 0.5M parameters."""

    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the random weight init.")
    vocab_size: int = Field(
        512,
        ge=MIN_VOCAB_SIZE,
        le=MAX_VOCAB_SIZE,
        description="Tokens in the vocabulary (bytes, merges, 3 special and 4 tool tokens); "
        "the model's embedding has exactly this many rows.",
    )
    tokenizer_corpus_seed: int = Field(
        0, ge=0, le=2**32 - 1, description="Seed of the generated corpus the tokenizer learns."
    )
    hidden_size: int = Field(128, ge=32, le=4096, description="Width of the residual stream.")
    num_layers: int = Field(3, ge=1, le=64, description="Decoder layers.")
    num_heads: int = Field(
        4,
        ge=1,
        le=64,
        description="Query heads; hidden_size / num_heads is the head size, which must be one "
        f"that vLLM's CPU attention supports: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}.",
    )
    num_kv_heads: int = Field(
        2, ge=1, le=64, description="Key/value heads (grouped-query attention); divides num_heads."
    )
    intermediate_size: int = Field(256, ge=8, le=16384, description="Width of the SwiGLU MLP.")
    max_position_embeddings: int = Field(
        2048, ge=64, le=131_072, description="Longest sequence (prompt + completion) in tokens."
    )
    rope_theta: float = Field(10_000.0, gt=0.0, le=1e9, description="RoPE base frequency.")
    rms_norm_eps: float = Field(1e-6, gt=0.0, le=1e-2, description="RMSNorm epsilon.")
    initializer_range: float = Field(
        0.02, gt=0.0, le=1.0, description="Standard deviation of the normal weight init."
    )
    tie_word_embeddings: bool = Field(
        True, description="Share the input embedding with the output projection (as Qwen2.5-0.5B)."
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _shapes_fit(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(
                f"head size hidden_size/num_heads = {self.head_dim} is not one vLLM's CPU "
                f"attention supports ({', '.join(map(str, VLLM_CPU_HEAD_DIMS))})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )
        return self
