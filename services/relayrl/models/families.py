"""The Hugging Face model families relayrl trains: what the trainer maps to megatron-core and
vLLM serves. Pure data, so that a command line can check a model folder before importing
torch."""

from __future__ import annotations

TRAINABLE_MODEL_TYPES = ("qwen2", "llama", "qwen3")
"""`model_type` values of config.json the trainer maps (relayrl.trainer.hf_mapping)."""
