"""`relayrl model import-gguf`: a GGUF checkpoint (llama.cpp's format) as a Hugging Face
folder the trainer and vLLM load -- config.json, safetensors, tokenizer and chat template.

transformers reads the GGUF and dequantises every tensor (a Q4_1 file becomes full-precision
weights with the quantisation error baked in: the imported model is the GGUF model, not the
model it was quantised from). The folder is written to a temporary sibling and renamed, so an
interrupted import leaves nothing that looks like a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from relayrl.models.families import TRAINABLE_MODEL_TYPES

Dtype = Literal["bf16", "fp32"]
PROVENANCE_FILE = "relayrl-import.json"

# GGUF `general.architecture` -> transformers model_type, for the architectures the trainer maps.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class GgufImportError(ValueError):
    """A GGUF file that cannot be imported; the message is one line that says why."""


@dataclass(frozen=True)
class ImportedModel:
    directory: Path
    model_type: str
    parameters: int
    dtype: Dtype
    source_sha256: str

    def summary(self) -> str:
        return (
            f"{self.directory} ({self.model_type}, {self.parameters / 1e6:.1f}M parameters, "
            f"{self.dtype})"
        )


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from the file's metadata (reads the header, not the tensors)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GgufImportError(f"{path} is not a readable GGUF file: {exc}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GgufImportError(f"{path} has no general.architecture in its metadata")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def import_gguf(
    gguf_file: Path, out_dir: Path, *, dtype: Dtype = "bf16", overwrite: bool = False
) -> ImportedModel:
    """Writes `gguf_file` as a Hugging Face model folder `out_dir`. GgufImportError (one line) for
    a missing or unreadable file, an architecture the trainer cannot map, a tokenizer without
    a chat template, or an `out_dir` that is not empty (unless `overwrite`)."""
    gguf_file = Path(gguf_file)
    out_dir = Path(out_dir)
    if not gguf_file.is_file():
        raise GgufImportError(f"{gguf_file} does not exist or is not a file")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise GgufImportError(f"{out_dir} is not empty; pass --force to write over it")
    architecture = gguf_architecture(gguf_file)
    model_type = _ARCHITECTURES.get(architecture)
    if model_type not in TRAINABLE_MODEL_TYPES:
        supported = ", ".join(a for a, t in _ARCHITECTURES.items() if t in TRAINABLE_MODEL_TYPES)
        raise GgufImportError(
            f"general.architecture {architecture!r} of {gguf_file} cannot be imported: relayrl "
            f"trains {supported}"
        )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    where, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    if not tokenizer.chat_template:
        raise GgufImportError(f"{gguf_file} carries no chat template (tokenizer.chat_template)")
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch_dtype)
    # The weights are dequantised tensors already: what transformers still records of the GGUF
    # quantisation would make save_pretrained refuse, and vLLM look for a GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    parameters = sum(p.numel() for p in model.parameters())

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        model.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)
        source_sha256 = _sha256(gguf_file)
        provenance = {"source": str(gguf_file.resolve()), "sha256": source_sha256, "dtype": dtype}
        (scratch / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        scratch.rename(out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ImportedModel(out_dir, model_type, parameters, dtype, source_sha256)
