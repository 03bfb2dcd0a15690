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
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from relayrl.core.access import TRAINER_ACCESS
from relayrl.core.logs import setup_logging
from relayrl.core.ports import free_port
from relayrl.trainer.config import TrainerConfig

if TYPE_CHECKING:  # torch and megatron load after the config, in the process that trains
    from relayrl.core.grpc_server import GrpcService
    from relayrl.tq import TransferQueue
    from relayrl.trainer.loop import Control, Leader, Status, TrainingLoop
    from relayrl.trainer.metrics import TrainerMetrics
    from relayrl.trainer.modes import TrainerMode
    from relayrl.trainer.servicer import TrainerServicer

logger = logging.getLogger(__name__)

TRAINER_SERVICE = "relayrl.proto.trainer.v1.Trainer"
EXIT_FAILED = 1


# -- ranks -------------------------------------------------------------------------------------


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

    def __init__(
        self, config: TrainerConfig, servicer: TrainerServicer, registry: CollectorRegistry
    ) -> None:
        self._config = config
        self._servicer = servicer
        self._registry = registry
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self.service: GrpcService | None = None
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
                access=[TRAINER_ACCESS],
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
    from relayrl.core.outage import OutageTimeout
    from relayrl.tq.errors import TQError
    from relayrl.trainer.loop import Control, State, Status
    from relayrl.trainer.progress import EXIT_NO_PROGRESS, NoProgress

    rank = int(os.environ.get("RANK", "0"))
    control, status = Control(), Status()
    _install_signal_handlers(control)
    front: _RankZeroFront | None = None
    try:
        mode = config.build_mode()  # one instance: the leader's and the loop's
        if rank == 0:
            front = _RankZeroFront(config, control, status)
            front.start(mode)
        loop = config.build_loop(
            config.build_policy(),
            mode,
            leader=front.leader if front else None,
            metrics=front.metrics if front else None,
            control=control,
            status=status,
        )
        return _train(loop, front, ready_file, rank)
    except NoProgress as exc:  # the watch logged the cause; a restart would wait again
        status.state, status.error = State.FAILED, str(exc)
        return EXIT_NO_PROGRESS
    except (OutageTimeout, ValueError, TQError, OSError) as exc:  # one line
        status.state, status.error = State.FAILED, str(exc)
        logger.error("%s", exc)
        return EXIT_FAILED
    finally:
        if front is not None:
            front.close()


class _RankZeroFront:
    """What rank 0 runs besides training: the gRPC service, the metrics and the leader over
    the TransferQueue. Started before the policy is built, so status answers during the load."""

    def __init__(self, config: TrainerConfig, control: Control, status: Status) -> None:
        self._config = config
        self._control = control
        self._status = status
        self.service: _ServiceThread | None = None
        self.metrics: TrainerMetrics | None = None
        self.leader: Leader | None = None

    def start(self, mode: TrainerMode) -> None:
        from relayrl.tq.metrics import TQCollector
        from relayrl.trainer.metrics import TrainerMetrics
        from relayrl.trainer.servicer import TrainerServicer

        config, status = self._config, self._status
        registry = CollectorRegistry()
        servicer = TrainerServicer(
            status,
            self._control,
            mode=config.algorithm.mode,
            total_steps=config.total_steps,
            world_size=config.model.tensor_parallel * config.model.data_parallel,
            checkpoints_enabled=config.checkpoint.dir is not None,
        )
        self.service = _ServiceThread(config, servicer, registry)
        self.service.start()
        self.metrics = TrainerMetrics(registry, config.metrics_log, config.staleness_threshold)
        tq = _open_queue(config)
        registry.register(TQCollector(tq, "trainer", [config.data.partition], lambda: status.step))
        self.leader = config.build_leader(tq, mode)

    def close(self) -> None:
        if self.leader is not None:
            self.leader.watch.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.service is not None:
            self.service.stop()


def _open_queue(config: TrainerConfig) -> TransferQueue:
    """The TransferQueue, once it answers (an outage is waited out for outage_timeout_s)."""
    from relayrl.core.outage import Outage
    from relayrl.tq import TransferQueue
    from relayrl.tq.queue import TQUnavailableError

    def open_queue() -> TransferQueue:
        queue = TransferQueue.from_config(config.tq)
        queue.check_durability()  # DurabilityError: refuse to start (one line)
        return queue

    return Outage(f"the TransferQueue ({config.tq.url})", config.outage_timeout_s).call(
        open_queue, (TQUnavailableError,)
    )


def _train(
    loop: TrainingLoop, front: _RankZeroFront | None, ready_file: Path | None, rank: int
) -> int:
    """Restore, announce readiness (rank 0), train; a requested stop saves its last steps."""
    from relayrl.core.grpc_server import write_ready_file
    from relayrl.trainer.loop import State

    loop.restore()
    if front is not None and front.service is not None and ready_file is not None:
        write_ready_file(ready_file, front.service.service, {"rank": rank, "step": loop.step})
    loop.status.state = State.WAITING
    loop.run()
    if loop.control.stop and loop.step % loop.config.checkpoint.interval_steps:
        loop.save()  # a requested stop keeps the work of the last steps
    logger.info("trainer stopped at step %d", loop.step)
    return 0


def _install_signal_handlers(control: Control) -> None:
    def on_signal(signum: int, frame: Any) -> None:
        if control.stop:
            logger.warning("second signal: exiting now")
            os._exit(128 + signum)
        logger.info("signal %d: stopping after the current step", signum)
        control.stop = True
        control.wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
