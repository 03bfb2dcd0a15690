"""Run megatron-core 0.16.1 on a machine without CUDA (CPU tensors, gloo collectives).

megatron-core assumes a GPU everywhere: about 175 `torch.cuda.current_device()` sites and 59
`device="cuda"` literals (in the schedule, the DDP grad buffers, the optimizer, the RoPE and
attention code), `param.type() == "torch.cuda.FloatTensor"` checks in its optimizers, and
calls to `torch.cuda.synchronize()`. On a CPU-only torch build each of these raises "Torch not
compiled with CUDA enabled". `install_cpu_compat()` maps those requests to the CPU:

- a `TorchFunctionMode` rewrites the CUDA device of factory functions and of
  `Tensor.to`/`Tensor.cuda` to `cpu` and drops `pin_memory=True` (which needs an accelerator);
  `Tensor.type()` called from megatron code reports the CUDA type name of a CPU tensor, so its
  dtype checks take the branch they would take on a GPU;
- `torch.cuda.current_device()` answers 0 (which the mode maps to `cpu`), and
  `torch.cuda.synchronize()` is a no-op (CPU kernels are synchronous).

What it does not do, and callers therefore do themselves (see `relayrl.trainer.model`):
seed with `model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)` (megatron's RNG
tracker snapshots CUDA generator states), pass an explicit boolean attention mask (the
default causal mask is built on `cuda` by a cached helper), and turn off the fused kernels.

The mode is thread-local, like every torch function mode: it covers the thread that called
`install_cpu_compat()`, the autograd work that thread starts (CPU backward runs in the
calling thread) and processes it forks (dist_checkpointing's writers). Another thread that
runs megatron calls `install_cpu_compat()` itself. `torch.cuda.Stream`/`Event` are left
alone: the DDP configuration `build_model` uses (no overlapped grad reduce) never creates
them, and `torch.cuda.memory_*`/`empty_cache` already answer harmlessly on a CPU build.
Nothing here is installed on a machine with CUDA: `install_cpu_compat()` then returns False
and changes nothing.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_cuda_functions_patched = False
_this_thread = threading.local()  # .mode: the _CudaToCpuMode pushed in this thread


def _is_cuda_device(device: object) -> bool:
    # An int device is an accelerator index (what `torch.cuda.current_device()` returns).
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


def _called_from_megatron() -> bool:
    # Frame 0 is this function, 1 the mode's handler; the first frame outside this module and
    # torch is the code that called the torch function.
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and not module.startswith("torch"):
            return module.startswith("megatron.")
        frame = frame.f_back
    return False


def _cuda_type_name(type_name: str) -> str:
    # "torch.FloatTensor" -> "torch.cuda.FloatTensor"
    if type_name.startswith("torch.") and not type_name.startswith("torch.cuda."):
        return "torch.cuda." + type_name[len("torch.") :]
    return type_name


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement requests to the CPU; every other call passes through."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            # Pinned host memory needs an accelerator; on CPU it only buys a crash.
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            # `t.cuda()` / `t.cuda(idx)`: the tensor already lives where the "GPU" is.
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.record_stream:
            # Stream bookkeeping for the caching allocator; there are no streams on CPU.
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            type_name = func(*args)
            # megatron's optimizers accept only "torch.cuda.{Float,Half,BFloat16}Tensor".
            return _cuda_type_name(type_name) if _called_from_megatron() else type_name
        return func(*args, **kwargs)


def _current_device() -> int:
    # megatron places tensors with `device=torch.cuda.current_device()`; the mode maps 0 to cpu.
    return 0


def _synchronize(device: object = None) -> None:
    # CPU kernels finish before they return; megatron synchronizes around frees and barriers.
    return None


_CUDA_PATCHES: dict[str, Callable[..., Any]] = {
    "current_device": _current_device,
    "synchronize": _synchronize,
}


def install_cpu_compat() -> bool:
    """Make megatron-core's CUDA device requests land on the CPU, in the calling thread.

    Returns True when the layer is active in this thread after the call (installed now or
    before), False when CUDA is available, in which case nothing at all is changed and
    megatron runs as written. Idempotent. The `torch.cuda` patches are process-wide; the
    device-rewriting mode is per thread (torch keeps function modes thread-local), so a thread
    that runs megatron calls this itself (`init_parallel` does, for its thread).
    """
    global _cuda_functions_patched
    if torch.cuda.is_available():
        return False
    with _lock:
        if not _cuda_functions_patched:
            for name, replacement in _CUDA_PATCHES.items():
                setattr(torch.cuda, name, replacement)
            _cuda_functions_patched = True
    if getattr(_this_thread, "mode", None) is None:
        mode = _CudaToCpuMode()
        mode.__enter__()  # stays on this thread's torch-function-mode stack for good
        _this_thread.mode = mode
    return True


def cpu_compat_installed() -> bool:
    """Whether `install_cpu_compat()` is active in the calling thread."""
    return getattr(_this_thread, "mode", None) is not None
