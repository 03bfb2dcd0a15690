"""`relayrl-trainer` as a process: build the model on every rank, serve status/control on
rank 0, train.

World size = model.tensor_parallel x model.data_parallel. Under a launcher that sets RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun, a Kubernetes StatefulSet) each process is one
rank. Started by hand with a world size above 1, the process becomes rank 0 and starts the other
ranks itself on this machine (same config, same environment), tracking them by PID.

Threads: megatron runs in the main thread (the CPU compatibility layer is thread-local, and the
training loop is the main thing this process does); rank 0 serves gRPC from a background thread
with its own event loop. SIGTERM / SIGINT ask the loop to stop after the current step (and save
a checkpoint); a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from relayrl.core.logs import setup_logging
from relayrl.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

TRAINER_SERVICE = "relayrl.proto.trainer.v1.Trainer"
EXIT_FAILED = 1


@dataclass
class Runtime:
    """Everything megatron-side one rank trains with."""

    spec: Any
    model: Any
    optimizer: Any
    scheduler: Any
    ref_model: Any
    layout: Any


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_runtime(config: TrainerConfig) -> Runtime:
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.loop import build_scheduler, seed_everything
    from relayrl.trainer.model import (
        OptimizerSettings,
        build_model,
        build_optimizer,
        init_parallel,
        load_hf_dir,
    )

    m, o = config.model, config.optim
    # every rank waits in a collective while rank 0 waits for data: give it the data wait
    layout = init_parallel(m.tensor_parallel, m.seed, timeout_s=config.data.wait_timeout_s + 600)
    if layout.world_size != m.tensor_parallel * m.data_parallel:
        raise ValueError(
            f"world size {layout.world_size} != model.tensor_parallel ({m.tensor_parallel}) x "
            f"model.data_parallel ({m.data_parallel})"
        )
    seed_everything(m.seed + layout.rank)
    spec = ModelSpec.from_hf_dir(m.hf_dir)
    dtype = _torch_dtype(m.params_dtype)
    model = build_model(
        spec, params_dtype=dtype, use_distributed_optimizer=o.use_distributed_optimizer
    )
    load_hf_dir(model, m.hf_dir)
    optimizer = build_optimizer(
        model,
        OptimizerSettings(
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            clip_grad=o.clip_grad,
        ),
    )
    scheduler = build_scheduler(config, optimizer)
    ref_model = None
    if config.algorithm.loss.kl_coef > 0:
        ref_model = build_model(spec, params_dtype=dtype)
        load_hf_dir(ref_model, m.hf_dir)
        for p in ref_model.parameters():
            p.requires_grad_(False)
    return Runtime(spec, model, optimizer, scheduler, ref_model, layout)


# -- ranks -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_local_ranks(
    config: TrainerConfig, world_size: int
) -> tuple[list[subprocess.Popen], Path]:
    """Rank 0 (this process) starts ranks 1..world_size-1 with the effective config: the
    fields that were set (so defaults are not mistaken for explicit choices), secrets
    included, in a file only this user can read."""
    port = str(free_port())
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
    )  # fmt: skip
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    handle, name = tempfile.mkstemp(prefix="relayrl-trainer-", suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump(config.model_dump(exclude_unset=True), f, default=_plain)
    children = []
    for rank in range(1, world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank))
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "relayrl.trainer.cli", "--config", name], env=env
            )
        )
    return children, Path(name)


def _plain(value: Any) -> Any:
    from pydantic import SecretStr

    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot pass {type(value).__name__} to a rank")


def _stop_children(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# -- rank 0's gRPC service ---------------------------------------------------------------------


class _ServiceThread:
    """The gRPC service on its own event loop in a daemon thread."""

    def __init__(self, config: TrainerConfig, servicer: Any, registry: CollectorRegistry) -> None:
        self._config = config
        self._servicer = servicer
        self._registry = registry
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self.service: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainer-grpc", daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the trainer's gRPC server did not start in time")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        from relayrl.core.grpc_server import build_service
        from relayrl.proto.trainer.v1 import trainer_pb2_grpc

        self._stopped = asyncio.Event()
        try:
            self.service = build_service(
                self._config,
                service_name="trainer",
                register=[
                    lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(self._servicer, s)
                ],
                service_names=[TRAINER_SERVICE],
                registry=self._registry,
            )
            await self.service.start()
        except BaseException as exc:  # reported to the starting thread
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stopped.wait()
        await self.service.stop()

    def stop(self) -> None:
        if self._stopped is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=60)


# -- the process -------------------------------------------------------------------------------


def quiet_megatron(level: str) -> None:
    """megatron logs every parameter of every gradient bucket at INFO and warns that Apex and
    Transformer Engine are absent (expected: the fallbacks are what runs on CPU)."""
    if level.upper() != "DEBUG":
        logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS")


def serve(config: TrainerConfig, ready_file: Path | None = None) -> int:
    setup_logging(config.logging, "trainer")
    quiet_megatron(config.logging.level)
    world_size = config.model.tensor_parallel * config.model.data_parallel
    children: list[subprocess.Popen] = []
    rank_config: Path | None = None
    if "WORLD_SIZE" not in os.environ:
        if world_size > 1:
            children, rank_config = _start_local_ranks(config, world_size)
        else:
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
            )  # fmt: skip
    try:
        return _serve_rank(config, ready_file)
    finally:
        _stop_children(children)
        if rank_config is not None:
            rank_config.unlink(missing_ok=True)


def _serve_rank(config: TrainerConfig, ready_file: Path | None) -> int:
    from relayrl.core.grpc_server import write_ready_file
    from relayrl.core.outage import Outage, OutageTimeout
    from relayrl.tq.errors import TQError
    from relayrl.tq.queue import TQUnavailableError
    from relayrl.trainer.loop import (
        Control,
        Leader,
        State,
        Status,
        TrainingLoop,
        data_parallel_from_megatron,
    )
    from relayrl.trainer.metrics import TrainerMetrics
    from relayrl.trainer.modes import mode_for
    from relayrl.trainer.replay import StepTimeout
    from relayrl.trainer.servicer import TrainerServicer

    rank = int(os.environ.get("RANK", "0"))
    control, status = Control(), Status()
    _install_signal_handlers(control)
    service: _ServiceThread | None = None
    leader = None
    metrics = None
    try:
        if rank == 0:
            from relayrl.tq import TransferQueue
            from relayrl.tq.metrics import TQCollector

            registry = CollectorRegistry()
            servicer = TrainerServicer(
                status,
                control,
                mode=config.algorithm.mode,
                total_steps=config.total_steps,
                world_size=config.model.tensor_parallel * config.model.data_parallel,
                checkpoints_enabled=config.checkpoint.dir is not None,
            )
            service = _ServiceThread(config, servicer, registry)
            service.start()
            metrics = TrainerMetrics(
                registry, config.metrics_log, config.algorithm.staleness_threshold
            )

            def open_queue() -> TransferQueue:
                queue = TransferQueue.from_config(config.tq)
                queue.check_durability()  # DurabilityError: refuse to start (one line)
                return queue

            tq = Outage(f"the TransferQueue ({config.tq.url})", config.outage_timeout_s).call(
                open_queue, (TQUnavailableError,)
            )
            registry.register(
                TQCollector(tq, "trainer", [config.data.partition], lambda: status.step)
            )
            leader = Leader(config, tq, mode_for(config.algorithm.mode))
        runtime = build_runtime(config)
        loop = TrainingLoop(
            config,
            model=runtime.model,
            optimizer=runtime.optimizer,
            scheduler=runtime.scheduler,
            spec=runtime.spec,
            ref_model=runtime.ref_model,
            leader=leader,
            metrics=metrics,
            control=control,
            status=status,
            data_parallel=data_parallel_from_megatron(),
        )
        loop.restore()
        if service is not None and ready_file is not None:
            write_ready_file(ready_file, service.service, {"rank": rank, "step": loop.step})
        status.state = State.WAITING
        loop.run()
        if control.stop and loop.step % config.checkpoint.interval_steps:
            loop.save()  # a requested stop keeps the work of the last steps
        logger.info("trainer stopped at step %d", loop.step)
        return 0
    except (StepTimeout, OutageTimeout, ValueError, TQError, OSError) as exc:  # one line
        status.state, status.error = State.FAILED, str(exc)
        logger.error("%s", exc)
        return EXIT_FAILED
    finally:
        if metrics is not None:
            metrics.close()
        if service is not None:
            service.stop()


def _install_signal_handlers(control: Any) -> None:
    def on_signal(signum: int, frame: Any) -> None:
        if control.stop:
            logger.warning("second signal: exiting now")
            os._exit(128 + signum)
        logger.info("signal %d: stopping after the current step", signum)
        control.stop = True
        control.wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
