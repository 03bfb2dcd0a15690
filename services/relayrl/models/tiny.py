"""A tiny Qwen2 causal LM with its tokenizer, built here from a seed: the model every CPU test,
benchmark and local run serves with vLLM and trains with Megatron.

    info = init_model(Path("models/tiny"), TinyModelConfig(seed=0))
    # models/tiny: config.json, generation_config.json, model.safetensors (fp32),
    #              tokenizer.json, tokenizer_config.json (ChatML template), special_tokens_map.json

The weights are `Qwen2ForCausalLM`'s own random init under `torch.manual_seed(seed)` (inside a
forked RNG, so the caller's RNG state is untouched): the same config gives bit-identical
weights, which `ModelInfo.weights_sha256` pins.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from relayrl.models.config import TinyModelConfig
from relayrl.models.tokenizer import (
    IM_END,
    PAD_TOKEN,
    TokenizerSpec,
    save_tokenizer,
    train_tokenizer,
)

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class ModelInfo:
    """What `init_model` wrote."""

    directory: Path
    num_params: int
    vocab_size: int
    weights_sha256: str
    tokenizer_sha256: str
    files: tuple[Path, ...]

    def summary(self) -> str:
        return (
            f"{self.num_params} parameters, vocab {self.vocab_size}, "
            f"weights sha256 {self.weights_sha256[:12]}, in {self.directory}"
        )


def qwen2_config(config: TinyModelConfig, tokenizer_ids: dict[str, int]) -> Qwen2Config:
    """The transformers config: Qwen2 (QKV bias, RoPE, RMSNorm, SwiGLU), fp32, no sliding
    window; `<|endoftext|>` is bos, `<|im_end|>` eos, as in Qwen2.5's instruct models."""
    return Qwen2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.rms_norm_eps,
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=tokenizer_ids[PAD_TOKEN],
        eos_token_id=tokenizer_ids[IM_END],
        architectures=["Qwen2ForCausalLM"],
        dtype="float32",
    )


def build_model(config: TinyModelConfig, qwen_config: Qwen2Config) -> Qwen2ForCausalLM:
    """The randomly initialized model; the same seed gives the same weights, bit for bit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(qwen_config)
    model.generation_config = GenerationConfig(
        bos_token_id=qwen_config.bos_token_id,
        # Greedy and sampling defaults stay the callers' (vLLM reads this file for defaults);
        # only the stop tokens are the model's.
        eos_token_id=[qwen_config.eos_token_id, qwen_config.bos_token_id],
        pad_token_id=qwen_config.bos_token_id,
    )
    return model.to(torch.float32).eval()


def weights_checksum(path: Path) -> str:
    """sha256 over every tensor of a safetensors file (name, dtype, shape, bytes), in name
    order: equal exactly when the weights are bit-identical, whatever the file's metadata."""
    digest = hashlib.sha256()
    with safe_open(str(path), framework="pt") as weights:
        for name in sorted(weights.keys()):
            tensor = weights.get_tensor(name).contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_directory(directory: Path, overwrite: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise ValueError(f"{directory} is not empty; pass --force to write the model over it")


def init_model(directory: Path, config: TinyModelConfig, *, overwrite: bool = False) -> ModelInfo:
    """Train the tokenizer, initialize the model and save both into `directory` in Hugging Face
    format. A non-empty directory is refused (ValueError) unless `overwrite`, which replaces
    the files written here and leaves any others."""
    _check_directory(directory, overwrite)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(TokenizerSpec(config.vocab_size, config.tokenizer_corpus_seed))
    tokenizer_files = save_tokenizer(tokenizer, directory, config.max_position_embeddings)
    model = build_model(config, qwen2_config(config, tokenizer.get_vocab()))
    with _no_progress_bars():
        model.save_pretrained(directory, safe_serialization=True)
    model_files = [directory / name for name in ("config.json", "generation_config.json")]
    _fix_config_dtype(model_files[0])
    weights = directory / WEIGHTS_FILE
    # safetensors writes 0600; a server running as another user (a pod) must read it too.
    weights.chmod(tokenizer_files[0].stat().st_mode & 0o777)
    return ModelInfo(
        directory=directory,
        num_params=sum(p.numel() for p in model.parameters()),
        vocab_size=tokenizer.get_vocab_size(),
        weights_sha256=weights_checksum(weights),
        tokenizer_sha256=hashlib.sha256(tokenizer_files[0].read_bytes()).hexdigest(),
        files=(*model_files, weights, *tokenizer_files),
    )


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    # save_pretrained draws a "Writing model shards" bar on stderr for a 2 MB file.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _fix_config_dtype(path: Path) -> None:
    # transformers 5 writes `dtype`; readers of the older key (transformers 4, checkpoint
    # converters) look for `torch_dtype`. Both say float32.
    config = json.loads(path.read_text(encoding="utf-8"))
    config["torch_dtype"] = config.setdefault("dtype", "float32")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
