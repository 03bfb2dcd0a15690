"""The policy as a megatron-core GPTModel: process groups, model, HF load/save, optimizer, and
a launcher that runs a function on N local ranks.

    init_parallel(tensor_model_parallel_size=2, seed=0)      # on every rank
    spec = ModelSpec.from_hf_dir(hf_dir)
    model = build_model(spec)                                 # megatron DDP(GPTModel)
    load_hf_dir(model, hf_dir)
    optimizer = OptimizerConfig(lr=1e-6).build(model)       # relayrl.trainer.config

On a machine without CUDA everything runs on the CPU with gloo (`megatron_compat`); the same
code runs megatron as written where CUDA is available.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from relayrl.core.ports import free_port
from relayrl.trainer.hf_mapping import ModelSpec, export_hf_tensors, hf_to_mcore
from relayrl.trainer.megatron_compat import install_cpu_compat

if TYPE_CHECKING:
    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.runtime import PolicyModel, PolicyOptimizer

WEIGHTS_FILE = "model.safetensors"
# What a Hugging Face folder holds besides its weights; copied verbatim by `save_hf_dir`.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SPEC_ATTR = "relayrl_model_spec"


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: global rank and the tensor-/data-parallel coordinates."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def _cuda() -> bool:
    return torch.cuda.is_available()


def init_parallel(
    tensor_model_parallel_size: int, seed: int, *, timeout_s: float = 600.0
) -> ParallelLayout:
    """Set up torch.distributed, megatron's process groups and model-parallel RNG.

    torch.distributed is used as it is when already initialised; otherwise it is initialised
    from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with NCCL on a GPU and
    gloo without one. Without CUDA the CPU compatibility layer is installed first, in this
    thread (megatron must then run in this thread). Pipeline parallelism is 1; the
    data-parallel size is world_size / tensor_model_parallel_size.
    """
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl" if _cuda() else "gloo",
            init_method="env://",
            timeout=timedelta(seconds=timeout_s),
        )
    world_size = torch.distributed.get_world_size()
    if tensor_model_parallel_size < 1 or world_size % tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size {tensor_model_parallel_size} does not divide the "
            f"world size {world_size}"
        )
    if _cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())))
    else:
        install_cpu_compat()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=1,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
    elif parallel_state.get_tensor_model_parallel_world_size() != tensor_model_parallel_size:
        raise ValueError(
            "megatron is already initialised with tensor-parallel size "
            f"{parallel_state.get_tensor_model_parallel_world_size()}, not "
            f"{tensor_model_parallel_size}; call destroy_parallel() first"
        )
    # The same CPU seed on every rank: with CPU initialisation megatron draws each full weight
    # from it and slices this rank's shard, so a fresh model is consistent across TP ranks.
    torch.manual_seed(seed)
    # megatron's tracker snapshots CUDA generator states; without CUDA the inference tracker
    # (whose fork() is a no-op) is the one that works. The model has no dropout, so nothing
    # in a forward pass draws from it.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not _cuda(), force_reset_rng=True
    )
    return current_layout()


def current_layout() -> ParallelLayout:
    """The `ParallelLayout` of this process (after `init_parallel`)."""
    from megatron.core import parallel_state

    return ParallelLayout(
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )


def destroy_parallel() -> None:
    """Undo `init_parallel` (megatron groups and the default process group)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def transformer_config(spec: ModelSpec, params_dtype: torch.dtype = torch.float32) -> Any:
    """megatron's TransformerConfig for a Qwen2/Llama decoder on the current TP size."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    spec.check_tensor_parallel(tp_size)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype {params_dtype} is not one of float32, bfloat16, float16")
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        # Draw weights on the CPU (the only device here; on a GPU it keeps a fresh model's
        # init independent of the TP layout).
        use_cpu_initialization=not _cuda(),
        # The fused kernels are CUDA/apex/TE-only or torch.compile'd; the eager paths are
        # exact and the ones that run on CPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Loss functions return (sum, num_tokens, metrics): megatron then neither divides by
        # the number of micro-batches nor averages over data-parallel ranks (see forward.py).
        calculate_per_token_loss=True,
    )


def build_model(
    spec: ModelSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_distributed_optimizer: bool = False,
    bucket_size: int | None = None,
) -> PolicyModel:
    """A megatron DDP-wrapped GPTModel (local layer spec: RMSNorm, SwiGLU, RoPE with the spec's
    theta, GQA, QKV bias and tied embeddings as the spec says; fused causal attention,
    relayrl.trainer.attention), randomly initialised.

    Gradients are accumulated in fp32 (`param.main_grad`) and summed, not averaged, over
    data-parallel ranks (`calculate_per_token_loss`); `use_distributed_optimizer` shards the
    optimizer state over data-parallel ranks and must match `build_optimizer`'s (it reads it
    from the model). Needs `init_parallel` first.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from relayrl.trainer.attention import FusedCausalAttention

    config = transformer_config(spec, params_dtype)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    layer_spec.submodules.self_attention.submodules.core_attention = FusedCausalAttention
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
    )
    if spec.rope_scaling is not None:
        # megatron's own llama3 scaling fixes low/high_freq_factor and the original context
        # (1, 4, 8192); the config's values are applied here instead, before any forward.
        rotary = gpt.rotary_pos_emb
        rotary.inv_freq = spec.rope_inv_freq().to(rotary.inv_freq.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    # Data-parallel replicas start from rank 0's weights, whatever their RNG did.
    model.broadcast_params()
    config.no_sync_func = model.no_sync

    def finalize_without_token_division(
        model_chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None, **kwargs: Any
    ) -> None:
        # megatron would divide the gradients by the summed num_tokens of the loss functions;
        # the caller's loss already carries its own (global) denominator.
        del num_tokens
        finalize_model_grads(model_chunks, None, **kwargs)

    config.finalize_model_grads_func = finalize_without_token_division
    setattr(gpt, _SPEC_ATTR, spec)
    return model


def unwrap_model(model: torch.nn.Module | PolicyModel) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP (or any `.module` wrapper)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """The `ModelSpec` a model was built from by `build_model`."""
    return getattr(unwrap_model(model), _SPEC_ATTR)


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `hf_dir/model.safetensors` (single-file checkpoints only)."""
    path = Path(hf_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} does not exist; load_hf_dir reads single-file safetensors checkpoints"
        )
    with safe_open(str(path), framework="pt") as weights:
        return {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118


@torch.no_grad()
def load_hf_dir(model: torch.nn.Module, hf_dir: Path) -> None:
    """Load a Hugging Face folder's weights into this rank's shard, strictly (every megatron
    tensor set, shapes checked). ValueError if the folder's config is not the model's spec."""
    from megatron.core import parallel_state

    spec = ModelSpec.from_hf_dir(hf_dir)
    built = model_spec(model)
    if spec != built:
        raise ValueError(f"{hf_dir} holds {spec}, but the model was built for {built}")
    state = hf_to_mcore(
        read_hf_weights(hf_dir),
        spec,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    gpt = unwrap_model(model)
    # Keep megatron's non-tensor entries (`_extra_state`) as they are.
    for name, value in gpt.state_dict().items():
        if name.endswith("_extra_state"):
            state.setdefault(name, value)
    gpt.load_state_dict(state, strict=True)


def _copy_non_weight_files(source: Path, target: Path) -> None:
    for path in sorted(Path(source).iterdir()):
        if not path.is_file() or path.name in _WEIGHT_INDEX_FILES:
            continue
        if path.suffix in _WEIGHT_SUFFIXES:
            continue
        shutil.copy2(path, target / path.name)


def save_hf_dir(
    model: torch.nn.Module, spec: ModelSpec, out_dir: Path, tokenizer_from: Path
) -> Path | None:
    """Write the model as a Hugging Face folder: `model.safetensors` (full, TP-gathered, fp32
    or the params' dtype) plus every non-weight file of `tokenizer_from` (config.json,
    generation_config.json, tokenizer files) copied verbatim.

    Collective: every rank takes part in the gather; global rank 0 writes into a temporary
    sibling folder and renames it to `out_dir` (which must not exist), so a reader never
    sees a half-written folder. Returns `out_dir` on rank 0, None elsewhere.
    """
    out_dir = Path(out_dir)
    tensors = {name: tensor.contiguous() for name, tensor in export_hf_tensors(model, spec)}
    written: Path | None = None
    if torch.distributed.get_rank() == 0:
        if out_dir.exists():
            raise ValueError(f"{out_dir} exists; save_hf_dir writes a new folder")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        _copy_non_weight_files(Path(tokenizer_from), staging)
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        # safetensors writes 0600; an engine running as another user must read it too.
        (staging / WEIGHTS_FILE).chmod(0o644)
        staging.chmod(0o755)
        staging.rename(out_dir)
        written = out_dir
    torch.distributed.barrier()
    return written


def build_optimizer(model: PolicyModel, settings: OptimizerConfig) -> PolicyOptimizer:
    """megatron's optimizer (Adam with decoupled weight decay, fp32 main params, global
    gradient-norm clipping) over the DDP model; distributed (ZeRO-1) exactly when the model
    was built with `use_distributed_optimizer=True` (the model decides, not
    `settings.use_distributed_optimizer`, which is what the model is built from).
    `settings.build(model)` calls this."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    config = unwrap_model(model).config
    optimizer_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.beta1,
        adam_beta2=settings.beta2,
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=model.ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    # As megatron's training loop does: the schedule scales each micro-batch loss by the
    # optimizer's loss scale before backward (1 except with fp16 loss scaling).
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


# ---------------------------------------------------------------------------- launcher


class RankFailedError(RuntimeError):
    """A rank started by `spawn_ranks` raised, died or timed out."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    num_threads: int,
) -> None:
    # Lead a process group of our own: dist_checkpointing starts helper processes (a
    # multiprocessing Manager server, forked writers) that outlive a killed rank otherwise.
    os.setpgid(0, 0)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Keep gloo's own sockets on loopback too, whatever the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(num_threads)
    try:
        torch.distributed.init_process_group(
            backend="gloo", init_method="env://", timeout=timedelta(seconds=300)
        )
        result = fn(rank, world_size, *args)
        # Plain pickle: the queue's own pickler would share tensors by file descriptor, which
        # dies with this process.
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            if "megatron.core.parallel_state" in sys.modules:
                sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes (spawned, so `fn` and
    `args` must pickle: a module-level function) with a gloo process group on a free loopback
    port already initialised; return each rank's return value, by rank.

    If a rank raises, dies or the whole run passes `timeout_s`, every rank is killed (SIGKILL
    to the process group each rank leads, which holds its helper processes too) and
    `RankFailedError` carries the failing rank's traceback. A script that calls this needs
    an `if __name__ == "__main__":` guard (spawned children import `__main__`).
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    num_threads = max(1, (os.cpu_count() or 1) // world_size)
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, results, num_threads),
            name=f"relayrl-rank-{rank}",
            # Not daemonic: dist_checkpointing's writer starts a multiprocessing Manager.
            # The finally clause below stops every rank's process group.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    succeeded = False
    try:
        values = _collect(processes, results, world_size, time.monotonic() + timeout_s)
        succeeded = True
        return values
    finally:
        for process in processes:
            if succeeded:
                # Let a rank that has posted its result tear its process groups down.
                process.join(timeout=_EXIT_GRACE_S)
            _kill_process_group(process.pid)
            process.join(timeout=_EXIT_GRACE_S)
        results.close()


_EXIT_GRACE_S = 60.0


def _kill_process_group(pid: int | None) -> None:
    # The rank leads its own process group (see _rank_main): this stops it and any helper
    # process it started, and nothing else.
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


_FAILURE_GRACE_S = 2.0


def _record(
    item: tuple[int, bool, Any], values: dict[int, Any], failures: list[tuple[int, str]]
) -> None:
    rank, ok, payload = item
    if ok:
        values[rank] = pickle.loads(payload)
    else:
        failures.append((rank, payload))


def _drain(
    results: Any, values: dict[int, Any], failures: list[tuple[int, str]], wait_s: float
) -> None:
    with contextlib.suppress(queue_module.Empty):
        while True:
            _record(results.get(timeout=wait_s), values, failures)


def _collect(processes: list[Any], results: Any, world_size: int, deadline: float) -> list[Any]:
    values: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    while len(values) < world_size and not failures:
        try:
            _record(results.get(timeout=0.2), values, failures)
            continue
        except queue_module.Empty:
            pass
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(values))
            raise RankFailedError(f"ranks {missing} did not finish in time")
        dead = [r for r, p in enumerate(processes) if r not in values and p.exitcode is not None]
        if dead:
            _drain(results, values, failures, wait_s=0.5)  # it may have posted just before
            silent = [r for r in dead if r not in values and r not in dict(failures)]
            if silent and not failures:
                code = processes[silent[0]].exitcode
                raise RankFailedError(f"rank {silent[0]} exited with code {code} without a result")
    if failures:
        # A rank's failure usually makes its peers fail too (broken collectives): collect
        # theirs briefly, and report the first one first.
        _drain(results, values, failures, wait_s=_FAILURE_GRACE_S)
        raise RankFailedError("\n".join(f"rank {r} failed:\n{text}" for r, text in failures))
    return [values[rank] for rank in range(world_size)]


def iter_hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`export_hf_tensors` with the model's own spec."""
    return export_hf_tensors(model, model_spec(model))
