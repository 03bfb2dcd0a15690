"""What one trainer rank trains with, and the contracts the trainer's modules hold it to.

The model, optimizer and scheduler are megatron's: a `DistributedDataParallel` around a
`GPTModel` (`relayrl.trainer.model.build_model`), a `MegatronOptimizer`
(`OptimizerConfig.build`) and an `OptimizerParamScheduler`
(`OptimizerConfig.build_scheduler`). The loop, the step, the publishers and the checkpoints
reach them only through the protocols below, which name what they call; a test may hand in
anything that has those members.

    policy = config.build_policy()     # collective: every rank, after init of the process group

This module imports neither torch nor megatron at import time (the config imports it for types).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from relayrl.trainer.config import TrainerConfig
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import ParallelLayout


class PolicyModel(Protocol):
    """megatron's `DistributedDataParallel` around a `GPTModel`, as `build_model` returns it.
    At run time it is a `torch.nn.Module`: the helpers that take any module, wrapped or not
    (`load_hf_dir`, `save_hf_dir`, `export_hf_tensors`), take it as one."""

    config: Any
    """megatron's `TransformerConfig` of the wrapped model (the schedule reads it)."""
    ddp_config: Any
    """megatron's `DistributedDataParallelConfig` (`use_distributed_optimizer`, ...)."""
    module: torch.nn.Module
    """The wrapped `GPTModel` (`unwrap_model` returns it)."""

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Logits [b, t, V/TP] of this rank's vocabulary shard."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def zero_grad_buffer(self) -> None:
        """Zero the fp32 gradient buffers (`param.main_grad`) before a forward-backward pass."""
        ...


class PolicyOptimizer(Protocol):
    """megatron's optimizer (`MegatronOptimizer` or `ChainedOptimizer`): Adam with fp32 main
    params, global gradient-norm clipping and, optionally, state sharded over data-parallel
    ranks."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def step(self) -> tuple[bool, float | None, int | None]:
        """(update applied, gradient norm before clipping or None, zeros in the grads)."""
        ...

    def get_grad_norm(self) -> float: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...

    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False, **kwargs: Any
    ) -> dict[str, Any]: ...


class LRScheduler(Protocol):
    """megatron's `OptimizerParamScheduler`: learning rate and weight decay per local update."""

    def step(self, increment: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class Policy:
    """Everything megatron-side one rank trains with."""

    spec: ModelSpec
    model: PolicyModel
    optimizer: PolicyOptimizer
    scheduler: LRScheduler
    ref_model: PolicyModel | None
    """A frozen copy of the starting weights, when the loss has a KL penalty."""
    layout: ParallelLayout


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_policy(config: TrainerConfig) -> Policy:
    """Process groups, then the model loaded from `model.hf_dir`, its optimizer and schedule,
    and the reference model when `algorithm.loss.kl_coef > 0`. Collective: every rank calls it.
    ValueError when the world size is not tensor_parallel x data_parallel."""
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.loop import seed_everything
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir

    m, optim = config.model, config.optim
    # every rank waits in a collective while rank 0 waits for data, which its stop rules bound
    layout = init_parallel(
        m.tensor_parallel, m.seed, timeout_s=config.progress.collective_timeout_s
    )
    if layout.world_size != m.tensor_parallel * m.data_parallel:
        raise ValueError(
            f"world size {layout.world_size} != model.tensor_parallel ({m.tensor_parallel}) x "
            f"model.data_parallel ({m.data_parallel})"
        )
    seed_everything(m.seed + layout.rank)
    spec = ModelSpec.from_hf_dir(m.hf_dir)
    dtype = torch_dtype(m.params_dtype)
    model = build_model(
        spec, params_dtype=dtype, use_distributed_optimizer=optim.use_distributed_optimizer
    )
    load_hf_dir(model, m.hf_dir)
    optimizer = optim.build(model)
    scheduler = optim.build_scheduler(
        optimizer, num_updates=config.total_steps * config.algorithm.parameter_sync_step
    )
    ref_model = None
    if config.algorithm.loss.kl_coef > 0:
        ref_model = build_model(spec, params_dtype=dtype)
        load_hf_dir(ref_model, m.hf_dir)
        for p in ref_model.parameters():
            p.requires_grad_(False)
    return Policy(spec, model, optimizer, scheduler, ref_model, layout)
