"""Trainer checkpoints: megatron `dist_checkpointing` for the model and optimizer shards, plus
a JSON dict of the caller's (step, data position, ...) and every rank's RNG states.

    save_checkpoint(root / "step_00000010", model, optimizer, {"step": 10})
    latest = latest_checkpoint(root)          # the complete checkpoint with the highest step
    common = load_checkpoint(latest, model, optimizer)

A checkpoint folder:

    common.json            the caller's dict plus the layout it was saved with
    dist/                  megatron dist_checkpointing (torch_dist): model + optimizer shards
    rng/rank_00000.pt      torch CPU (and CUDA) RNG, Python and NumPy RNG, megatron tracker

Saving is atomic: every rank writes into `.{name}.partial` next to the target, and rank 0
renames it into place only after all ranks are done, so a process killed mid-save leaves the
previous checkpoints intact (and a `.partial` folder that the next save of that name removes
and `latest_checkpoint` ignores).

dist_checkpointing needs `psutil`; like every multi-process launch here, a script that starts
ranks with `spawn_ranks` needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from relayrl.trainer.model import current_layout, unwrap_model

if TYPE_CHECKING:
    from relayrl.trainer.runtime import PolicyModel, PolicyOptimizer

logger = logging.getLogger(__name__)

COMMON_FILE = "common.json"
DIST_DIR = "dist"
RNG_DIR = "rng"
FORMAT_VERSION = 1


def _partial_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.partial"


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank_{rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors, lists and numbers only, so that loading it needs no
    unpickling of arbitrary objects (`torch.load(weights_only=True)`: a checkpoint folder
    someone else could write must not be able to run code in the trainer)."""
    from megatron.core import tensor_parallel

    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            position,
            has_gauss,
            cached_gauss,
        ],
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    kind, keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


def _load_rng_state(path: Path) -> dict[str, Any] | None:
    """The RNG states saved at `path`, read without unpickling arbitrary objects; None (with a
    warning) for a file in the older format that needs it."""
    try:
        state: dict[str, Any] = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        logger.warning(
            "%s holds RNG states in a format that needs unsafe unpickling (an older relayrl): "
            "not restored, training goes on with fresh RNG states (%s)",
            path,
            str(exc).splitlines()[0],
        )
        return None
    return state


def _allocate_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer zeroed Adam state (moments 0, step 0: exactly what Adam
    starts from, so the next step is unchanged).

    Without it a checkpoint saved before the first step holds no optimizer state and cannot
    be loaded, and (without apex/Transformer Engine) megatron's DistributedOptimizer cannot
    even describe what it wants to load: its state_dict() asserts that the torch optimizer's
    per-parameter `step` has exactly one value.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        init_state_fn = getattr(inner, "init_state_fn", None)
        if init_state_fn is None or len(inner.optimizer.state) > 0:
            continue
        init_state_fn(inner.optimizer, inner.config)
        for param_state in inner.optimizer.state.values():
            param_state.setdefault("step", torch.tensor(0.0))


def _fill_zero_common_step(optimizer_state: Any) -> None:
    """Give a loaded non-distributed optimizer state its Adam step when that step was 0.

    megatron 0.16.1 saves the shared Adam step of its (non-distributed) optimizers only
    `if step:`, so a checkpoint saved before the first step has none, and torch's Adam then
    refuses the state (KeyError: 'step').
    """
    for state in optimizer_state if isinstance(optimizer_state, list) else [optimizer_state]:
        if not isinstance(state, dict):
            continue
        # fp32: {"state", "param_groups"}; fp16/bf16: {"optimizer": {"state", ...}, ...}.
        # The distributed optimizer keeps its step in param_groups and has no "state" here.
        inner = state.get("optimizer", state)
        if isinstance(inner, dict) and isinstance(inner.get("state"), dict):
            per_param = inner["state"]
            if "common_step" not in per_param and per_param:
                per_param["common_step"] = torch.tensor(0.0)


def _saved_adam_steps(optimizer: Any, optimizer_state: Any) -> list[float | None]:
    """The Adam step count each (chained) distributed optimizer saved, read before loading."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    states = optimizer_state if isinstance(optimizer_state, list) else [optimizer_state]
    steps: list[float | None] = []
    for inner, state in zip(inners, states, strict=True):
        groups = state.get("optimizer", {}).get("param_groups", []) if state else []
        values = {group["step"] for group in groups if group.get("step") is not None}
        is_distributed = isinstance(inner, DistributedOptimizer)
        steps.append(float(values.pop()) if is_distributed and len(values) == 1 else None)
    return steps


def _restore_adam_steps(optimizer: Any, steps: list[float | None]) -> None:
    """Put the saved step back into every parameter's Adam state, one tensor each.

    megatron 0.16.1's DistributedOptimizer with torch's AdamW (no apex/TE) loses the step in
    a dp_reshardable load (the per-parameter copy writes back the fresh optimizer's step) and
    hands every parameter the same step tensor, which torch's AdamW would increment once per
    parameter. Both would change Adam's bias correction after a resume.
    """
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner, step in zip(inners, steps, strict=True):
        if step is None:
            continue
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _sharded_state_dict(
    model: PolicyModel, optimizer: PolicyOptimizer, *, is_loading: bool
) -> dict:
    _allocate_optimizer_state(optimizer)
    model_sd = unwrap_model(model).sharded_state_dict()
    return {
        "model": model_sd,
        # dp_reshardable: the distributed optimizer's own buffers, loadable under another
        # data-parallel size (not another TP size). In megatron 0.16.1 with torch's AdamW the
        # default, fully_sharded_model_space, fails ("ShardedTensor.flattened_range is not
        # supported") and fully_reshardable cannot load ("KeyError: 'step'").
        "optimizer": optimizer.sharded_state_dict(
            model_sd,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"},
        ),
    }


def save_checkpoint(
    directory: Path, model: PolicyModel, optimizer: PolicyOptimizer, common: dict[str, Any]
) -> Path:
    """Save model, optimizer, `common` (JSON-serialisable) and every rank's RNG to
    `directory`, atomically. Collective: every rank calls it with the same arguments.
    ValueError if `directory` exists or `common` is not JSON-serialisable."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    layout = current_layout()
    try:
        common_text = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "common": common,
                "world_size": layout.world_size,
                "tp_size": layout.tp_size,
                "dp_size": layout.dp_size,
            },
            indent=2,
            sort_keys=True,
        )
    except TypeError as error:
        raise ValueError(f"common must be JSON-serialisable: {error}") from error
    if directory.exists():
        raise ValueError(f"{directory} exists; a checkpoint is written once")
    partial = _partial_dir(directory)
    if layout.rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # left by a save that was killed
        (partial / DIST_DIR).mkdir(parents=True)
        (partial / RNG_DIR).mkdir()
    torch.distributed.barrier()

    torch.save(_rng_state(), _rng_file(partial, layout.rank))
    dist_checkpointing.save(
        _sharded_state_dict(model, optimizer, is_loading=False), str(partial / DIST_DIR)
    )
    torch.distributed.barrier()  # every rank's files are on disk
    if layout.rank == 0:
        (partial / COMMON_FILE).write_text(common_text + "\n", encoding="utf-8")
        partial.rename(directory)
    torch.distributed.barrier()
    return directory


def load_checkpoint(
    directory: Path, model: PolicyModel, optimizer: PolicyOptimizer
) -> dict[str, Any]:
    """Load model and optimizer state and this rank's RNG states from `directory`; return the
    `common` dict it was saved with. Collective. The model/optimizer shards reshard to the
    current parallel layout; the RNG states are restored only when the world size is the one
    saved (a warning says so otherwise)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    common_file = directory / COMMON_FILE
    if not common_file.is_file():
        raise ValueError(f"{directory} is not a complete checkpoint (no {COMMON_FILE})")
    saved = json.loads(common_file.read_text(encoding="utf-8"))
    state = dist_checkpointing.load(
        _sharded_state_dict(model, optimizer, is_loading=True), str(directory / DIST_DIR)
    )
    with torch.no_grad():
        unwrap_model(model).load_state_dict(state["model"], strict=True)
        # no_grad: for fp32 params the distributed optimizer's main params are views of the
        # model's leaf params, which its dp_reshardable loader copies into in place.
        _fill_zero_common_step(state["optimizer"])
        steps = _saved_adam_steps(optimizer, state["optimizer"])
        optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(optimizer, steps)
    layout = current_layout()
    if saved["world_size"] == layout.world_size:
        if (rng := _load_rng_state(_rng_file(directory, layout.rank))) is not None:
            _set_rng_state(rng)
    elif layout.rank == 0:
        logger.warning(
            "checkpoint %s was saved by %d ranks, not %d: RNG states not restored",
            directory,
            saved["world_size"],
            layout.world_size,
        )
    torch.distributed.barrier()
    return saved["common"]


def _step_of(directory: Path) -> int:
    common = json.loads((directory / COMMON_FILE).read_text(encoding="utf-8"))["common"]
    step = common.get("step") if isinstance(common, dict) else None
    return step if isinstance(step, int) else -1


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint under `root` with the highest `common["step"]` (ties and
    step-less ones by name), or None. Partial (`.`-prefixed) folders are ignored."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [
        path
        for path in root.iterdir()
        if path.is_dir() and not path.name.startswith(".") and (path / COMMON_FILE).is_file()
    ]
    if not complete:
        return None
    return max(complete, key=lambda path: (_step_of(path), path.name))
