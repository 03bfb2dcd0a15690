"""The Trainer gRPC service: status and control of the running loop (transport only; the loop
reads `Control` between steps)."""

from __future__ import annotations

import asyncio

import grpc

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from relayrl.trainer.loop import Control, State, Status

_STATES = {
    State.STARTING: trainer_pb2.TRAINER_STATE_STARTING,
    State.TRAINING: trainer_pb2.TRAINER_STATE_TRAINING,
    State.WAITING: trainer_pb2.TRAINER_STATE_WAITING,
    State.PAUSED: trainer_pb2.TRAINER_STATE_PAUSED,
    State.CHECKPOINTING: trainer_pb2.TRAINER_STATE_CHECKPOINTING,
    State.STOPPED: trainer_pb2.TRAINER_STATE_STOPPED,
    State.FAILED: trainer_pb2.TRAINER_STATE_FAILED,
}


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(
        self,
        status: Status,
        control: Control,
        *,
        mode: str,
        total_steps: int,
        world_size: int,
        checkpoints_enabled: bool,
        checkpoint_wait_s: float = 600.0,
    ) -> None:
        self._status = status
        self._control = control
        self._mode = mode
        self._total_steps = total_steps
        self._world_size = world_size
        self._checkpoints_enabled = checkpoints_enabled
        self._checkpoint_wait_s = checkpoint_wait_s

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetStatusResponse:
        s = self._status
        return trainer_pb2.GetStatusResponse(
            state=_STATES[s.state],
            mode=self._mode,
            step=s.step,
            total_steps=self._total_steps,
            published_version=common_pb2.WeightVersion(
                version=s.published_version, trainer_step=s.step
            ),
            last_checkpoint_step=s.last_checkpoint_step,
            staleness_histogram={int(k): int(v) for k, v in s.staleness_histogram.items()},
            metrics=dict(s.metrics),
            world_size=self._world_size,
        )

    async def Control(
        self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ControlResponse:
        control, action = self._control, request.action
        if action == trainer_pb2.CONTROL_ACTION_PAUSE:
            control.paused = True
        elif action == trainer_pb2.CONTROL_ACTION_RESUME:
            control.paused = False
        elif action == trainer_pb2.CONTROL_ACTION_STOP:
            control.stop = True
        elif action == trainer_pb2.CONTROL_ACTION_CHECKPOINT:
            return await self._checkpoint(context)
        else:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "action must be one of PAUSE, RESUME, CHECKPOINT, STOP",
            )
        control.wake.set()
        return trainer_pb2.ControlResponse(state=_STATES[self._status.state])

    async def _checkpoint(self, context: grpc.aio.ServicerContext) -> trainer_pb2.ControlResponse:
        """Asks for a checkpoint after the current step and waits for it (up to the call's
        deadline or checkpoint_wait_s)."""
        if not self._checkpoints_enabled:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "checkpoints are disabled: set checkpoint.dir in the trainer config",
            )
        before = self._status.last_checkpoint_step
        self._control.checkpoint_now = True
        self._control.wake.set()
        remaining = context.time_remaining()
        limit = min(self._checkpoint_wait_s, remaining) if remaining else self._checkpoint_wait_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while self._status.last_checkpoint_step == before:
            if self._status.state in (State.STOPPED, State.FAILED) or loop.time() > deadline:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no checkpoint within {limit:.0f}s (trainer state "
                    f"{self._status.state.value}); it is still requested for the next step",
                )
            await asyncio.sleep(0.1)
        return trainer_pb2.ControlResponse(
            state=_STATES[self._status.state],
            checkpoint_step=self._status.last_checkpoint_step,
        )
