"""The environment `relayrl engine` execs vLLM with (relayrl.engine.launcher): what makes a
restarted engine, or the next run's, find what an earlier one built."""

from __future__ import annotations

from pathlib import Path

from relayrl.engine.config import EngineConfig
from relayrl.engine.launcher import MAX_TMPDIR_CHARS, vllm_environment


def config(tmp_path: Path, cache: Path) -> EngineConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return EngineConfig(model=model, cache_dir=cache, device="cpu")


def test_compiled_kernels_live_in_the_cache_folder_whatever_the_tmpdir(tmp_path: Path) -> None:
    cache = tmp_path / ("a-long-runs-folder-name-" * 4) / "cache" / "vllm"
    env = vllm_environment(config(tmp_path, cache), base={})
    assert env["VLLM_CACHE_ROOT"] == str(cache)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "torchinductor")
    # TMPDIR is shortened for vLLM's ipc sockets: the kernels must not follow it
    assert len(env["TMPDIR"]) <= MAX_TMPDIR_CHARS < len(str(cache / "tmp"))


def test_a_kernel_cache_the_caller_chose_is_kept(tmp_path: Path) -> None:
    env = vllm_environment(
        config(tmp_path, tmp_path / "cache"), base={"TORCHINDUCTOR_CACHE_DIR": "/srv/kernels"}
    )
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/srv/kernels"
