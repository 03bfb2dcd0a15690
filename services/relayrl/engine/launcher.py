"""`relayrl engine`: start a vLLM OpenAI server for one engine replica, with the RL endpoints
(pause/resume, weight version, collective RPC), the token-in/token-out generate endpoint and
relayrl's worker extension.

The command execs vLLM itself, so the engine *is* the process a supervisor started: its PID,
its signals, its exit code. On cpu it applies the settings measured on our CPU machines
(docs/platform.md#vllm-on-cpu: eager mode, in-process executor, ~25 s to ready).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from relayrl.engine.config import WEIGHTSYNC_TLS_ENV, EngineConfig
from relayrl.engine.guard import CALLERS_ENV, load_callers

WORKER_EXTENSION = "relayrl.engine.worker_extension.RelayrlWorkerExtension"
GUARD = "relayrl.engine.guard.EngineGuard"
LOAD_DIRS_ENV = "RELAYRL_ENGINE_LOAD_DIRS"
"""Where relayrl_load_tensors may read files (the worker extension checks)."""
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def resolve_device(config: EngineConfig) -> str:
    if config.device != "auto":
        return config.device
    return "cuda" if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists() else "cpu"


def check_model_dir(model: Path) -> None:
    """Raise ValueError saying what is missing when `model` is not a loadable HF folder."""
    if not model.is_dir():
        raise ValueError(f"model folder {model} does not exist (make one: relayrl model init DIR)")
    for name in ("config.json", "tokenizer_config.json"):
        if not (model / name).is_file():
            raise ValueError(f"model folder {model} has no {name}; is it a Hugging Face model?")


def vllm_command(config: EngineConfig, python: str = sys.executable) -> list[str]:
    device = resolve_device(config)
    dtype = (
        config.dtype if config.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    )
    argv = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", str(config.model),
        "--served-model-name", config.served_model_name,
        "--host", config.host,
        "--port", str(config.port),
        "--dtype", dtype,
        "--max-model-len", str(config.max_model_len),
        "--max-num-seqs", str(config.max_num_seqs),
        "--seed", str(config.seed),
        "--enable-scale-out",  # /inference/v1/generate: token ids in, token ids out
        # the sampled tokens' log-probs under the distribution they were sampled from (after
        # the temperature), as the trainer computes pi: vLLM's default, raw_logprobs, is the
        # temperature-1 distribution, 0.18 nats per token away from it at temperature 0.6
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    argv.append(
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if device == "cpu":
        argv += ["--enforce-eager", "--distributed-executor-backend", "uni"]
    else:
        argv += [
            "--tensor-parallel-size", str(config.tensor_parallel_size),
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
        ]  # fmt: skip
    if config.callers_file is not None:
        argv += ["--middleware", GUARD]
    return argv + list(config.extra_args)


# vLLM's engine core talks over ZeroMQ ipc:// sockets created in TMPDIR, and a Unix socket
# path may not exceed 107 bytes.
MAX_TMPDIR_CHARS = 60


def short_tmpdir(preferred: Path) -> Path:
    """`preferred` if short enough for vLLM's ipc sockets, else a short, stable folder under
    the system temp dir named after it."""
    if len(str(preferred)) <= MAX_TMPDIR_CHARS:
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"relayrl-vllm-{digest}"


def vllm_environment(config: EngineConfig, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    cache = config.cache_dir or config.model.parent / ".vllm-cache"
    env = {
        # The kernels torch compiles on the engine's first requests (about 10 s of a C++
        # compiler here) are kept in the cache folder, where every engine that shares it finds
        # them: by default they would go to TMPDIR, which short_tmpdir may make a folder of its
        # own per path. A value the caller set is kept.
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        **base,
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, weight version
        "VLLM_CACHE_ROOT": str(cache),
        "TMPDIR": str(short_tmpdir(cache / "tmp")),
    }
    if config.callers_file is not None:
        env[CALLERS_ENV] = str(config.callers_file.absolute())
    folders = [config.model, *config.load_dirs]
    env[LOAD_DIRS_ENV] = os.pathsep.join(str(folder.absolute()) for folder in folders)
    if config.weightsync_tls is not None:
        tls = config.weightsync_tls
        absolute = {
            name: str(path.absolute())
            for name in ("ca_file", "cert_file", "key_file")
            if (path := getattr(tls, name)) is not None
        }
        env[WEIGHTSYNC_TLS_ENV] = tls.model_copy(update=absolute).model_dump_json()
    if resolve_device(config) == "cpu":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_space_gib)
    return env


def exec_engine(config: EngineConfig) -> None:
    """Replace this process with the vLLM server (never returns)."""
    check_model_dir(config.model)
    env = vllm_environment(config)
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    argv = vllm_command(config)
    os.execve(argv[0], argv, env)


def main(argv: list[str] | None = None, prog: str = "relayrl engine") -> int:
    """`relayrl engine [MODEL] [--config FILE] [--host H] [--port N] [--print-command]`."""
    import argparse
    import shlex

    parser = argparse.ArgumentParser(
        prog=prog,
        description="start a vLLM OpenAI server (one engine replica) with relayrl's worker "
        "extension and the RL endpoints",
        epilog="Every config field can also be set by RELAYRL_ENGINE__<FIELD>.",
    )
    parser.add_argument("model", nargs="?", help="model folder (overrides the config's `model`)")
    parser.add_argument("--config", metavar="FILE", help="YAML EngineConfig")
    parser.add_argument("--host", help="interface to bind")
    parser.add_argument("--port", type=int, help="HTTP port")
    parser.add_argument(
        "--print-command", action="store_true", help="print the vLLM command line and exit"
    )
    args = parser.parse_args(argv)
    from relayrl.core.config import ClientCredentialsConfig, ConfigError, load_config
    from relayrl.core.grpc_client import ClientIdentity

    environ = dict(os.environ)
    for name in ("model", "host", "port"):
        value = getattr(args, name)
        if value is not None:
            environ[f"RELAYRL_ENGINE__{name.upper()}"] = str(value)
    try:
        config = load_config(EngineConfig, args.config, "RELAYRL_ENGINE", environ)
        check_model_dir(config.model)
    except (ConfigError, ValueError) as exc:
        message = str(exc)
        if "model" in message and "Field required" in message:
            message = "no model folder: give MODEL or set `model` in --config"
        print(f"{prog}: {message}", file=sys.stderr)
        return 2
    if args.print_command:
        print(shlex.join(vllm_command(config)))
        return 0
    if config.callers_file is None:
        print(f"{prog}: warning: no callers_file: every caller may call every route of this "
              "engine, /collective_rpc included", file=sys.stderr)  # fmt: skip
    else:
        try:
            load_callers(config.callers_file)
        except ConfigError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    if config.weightsync_tls is not None:
        try:  # the files the workers will read at the first load: said now, in one line
            ClientIdentity.from_config(
                ClientCredentialsConfig(tls=config.weightsync_tls), "weightsync_tls"
            )
        except ConfigError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    exec_engine(config)
    return 0  # not reached: exec_engine replaces the process
