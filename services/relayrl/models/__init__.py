"""relayrl.models: the tiny Qwen2 model and its tokenizer, built locally from a seed (no
downloads), for CPU tests, benchmarks and local runs. `relayrl model init DIR` writes one.

    from relayrl.models import TinyModelConfig
    from relayrl.models.tiny import init_model      # imports torch and transformers
    info = init_model(Path("models/tiny"), TinyModelConfig(seed=0))

This package exports only what is light (pydantic, `tokenizers`); the model builder lives in
`relayrl.models.tiny` so that checking a config does not import torch.
"""

from relayrl.models.config import VLLM_CPU_HEAD_DIMS, TinyModelConfig
from relayrl.models.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    TokenizerSpec,
    corpus_lines,
    save_tokenizer,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "IM_END",
    "IM_START",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "VLLM_CPU_HEAD_DIMS",
    "TinyModelConfig",
    "TokenizerSpec",
    "corpus_lines",
    "save_tokenizer",
    "train_tokenizer",
]
