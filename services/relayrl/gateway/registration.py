"""The gateway's half of replica membership: every healthy replica is registered with
weight-sync, again every `engines.register_interval_s` and at once when it starts waiting to
be loaded.

A registration asks weight-sync to reconcile the replica: weight-sync checks which weights
the replica's workers hold and, when that is not the committed version, loads it before it
tells the gateway to route to it (ResumeReplicas with the version). Registering again and
again is what makes restarts harmless: a restarted weight-sync learns the replicas within one
interval, a restarted gateway's replicas (which all start in LOADING) are confirmed or loaded,
and a replica that stops being registered (unhealthy, gone) stops taking part in version
switches after weight-sync's registration_ttl_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from relayrl.core.config import GrpcClientConfig
from relayrl.gateway.agents import policy_version
from relayrl.gateway.replicas import Replica, ReplicaPool, ReplicaState

logger = logging.getLogger(__name__)

REGISTERED_STATES = (ReplicaState.SERVING, ReplicaState.PAUSED, ReplicaState.LOADING)


class WeightSyncRegistrar:
    def __init__(self, pool: ReplicaPool, config: GrpcClientConfig, interval_s: float) -> None:
        from relayrl.core.grpc_client import channel_from_config
        from relayrl.proto.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc

        self._pool = pool
        self._target = config.target
        self._timeout_s = min(config.default_timeout_s, max(interval_s, 1.0) * 5)
        self._interval_s = interval_s
        self._pb = weightsync_pb2
        self._channel = channel_from_config(config, label="weightsync")
        self._stub = weightsync_pb2_grpc.WeightSyncStub(self._channel)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unreachable = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="weightsync-registration")

    def poke(self, replica: Replica) -> None:
        """A replica changed state: register it now when it waits to be loaded."""
        if replica.state is ReplicaState.LOADING:
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self.register_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            self._wake.clear()

    async def register_all(self) -> None:
        replicas = [r for r in self._pool.replicas if r.state in REGISTERED_STATES]
        results = await asyncio.gather(
            *(self._register(r) for r in replicas), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        if errors and not self._unreachable:
            self._unreachable = True
            logger.warning(
                "cannot register replicas with weight-sync at %s (%s: %s); replicas waiting "
                "for their weights stay out of routing until it answers",
                self._target, errors[0].code().name, errors[0].details(),
            )  # fmt: skip
        elif not errors and self._unreachable and replicas:
            self._unreachable = False
            logger.info("weight-sync at %s answers registrations again", self._target)
        for result in results:
            if isinstance(result, Exception) and not isinstance(result, grpc.aio.AioRpcError):
                logger.error("registering a replica failed: %r", result)

    async def _register(self, replica: Replica) -> None:
        version = policy_version(replica.weight_version) if replica.weight_version else 0
        await self._stub.RegisterEngine(
            self._pb.RegisterEngineRequest(
                replica_id=replica.replica_id,
                url=getattr(replica.client, "base_url", ""),
                current_version=max(version, 0),
                # PAUSED is in routing (whoever paused it resumes it); LOADING waits for
                # weight-sync to resume it at the committed version
                routed=replica.state is not ReplicaState.LOADING,
            ),
            timeout=self._timeout_s,
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()
