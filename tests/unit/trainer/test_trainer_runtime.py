"""The trainer's runtime is built by its config: one optimizer settings type, one mode per build,
the schedule the settings describe, and protocols that megatron's classes satisfy."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from relayrl.trainer import runtime
from relayrl.trainer.config import OptimizerConfig, TrainerConfig


@pytest.mark.parametrize(
    ("algorithm", "eta"),
    [
        ({"mode": "sync"}, 0),
        ({"mode": "colocate_async"}, 1),
        ({"mode": "separate_async", "parameter_sync_step": 2}, 2),
    ],
)
def test_the_config_builds_its_mode(algorithm: dict, eta: int) -> None:
    config = TrainerConfig.model_validate({"algorithm": algorithm, "rollout_shape": {"eta": eta}})
    mode = config.build_mode()
    assert mode.name == algorithm["mode"]
    assert config.build_mode() is not mode  # one per build: the run builds it once and shares it


def test_the_config_builds_what_it_names() -> None:
    from relayrl.trainer.publish import HfDirPublisher, NoPublisher

    config = TrainerConfig()
    assert isinstance(config.build_publisher(), NoPublisher)
    assert config.build_feeder(tq=None) is None  # no prompts_file: someone else feeds
    assert config.build_gateway_link() is None
    hf = TrainerConfig.model_validate({"publish": {"type": "hf_dir", "dir": "/tmp/v"}})
    assert isinstance(hf.build_publisher(), HfDirPublisher)


def _lrs(settings: OptimizerConfig, num_updates: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = settings.build_scheduler(optimizer, num_updates=num_updates)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(num_updates):
        scheduler.step(increment=1)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_the_schedule_is_the_one_the_settings_describe() -> None:
    assert _lrs(OptimizerConfig(lr=1e-3), 4) == pytest.approx([1e-3] * 5)
    warm = _lrs(OptimizerConfig(lr=1e-3, min_lr=1e-4, schedule="linear", warmup_updates=2), 6)
    assert warm[0] == 0.0 and warm[2] == pytest.approx(1e-3)
    assert warm[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in itertools.pairwise(warm[2:]))
    assert _lrs(OptimizerConfig(lr=1e-3), 0) == pytest.approx([1e-3])  # a run of 0 steps


@pytest.mark.filterwarnings("ignore::UserWarning")  # megatron: Apex / Transformer Engine absent
def test_megatrons_classes_have_what_the_protocols_name() -> None:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    pairs = [
        (runtime.LRScheduler, OptimizerParamScheduler),
        (runtime.PolicyOptimizer, MegatronOptimizer),
        (runtime.PolicyOptimizer, ChainedOptimizer),
    ]
    for protocol, cls in pairs:
        for name in _protocol_methods(protocol):
            assert callable(getattr(cls, name, None)) or isinstance(
                inspect.getattr_static(cls, name, None), property
            ), f"{cls.__name__} has no {name}"
    for name in ("zero_grad_buffer", "parameters", "__call__"):
        assert callable(getattr(DistributedDataParallel, name, None)), name
    # the attributes the model protocol names are set by DistributedDataParallel.__init__
    source = inspect.getsource(DistributedDataParallel.__init__)
    for attribute in ("self.ddp_config", "self.module"):
        assert attribute in source, attribute


def _protocol_methods(protocol: type) -> list[str]:
    return [
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]
