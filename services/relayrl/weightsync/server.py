"""relayrl-weightsync as a process: the coordinator behind the WeightSync gRPC service."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from relayrl.core.access import WEIGHTSYNC_ACCESS
from relayrl.core.config import load_client_token
from relayrl.core.grpc_server import GrpcService, build_service, serve_process, write_ready_file
from relayrl.inference.config import EngineHttpConfig
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.coordinator import Coordinator
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.servicer import WeightSyncServicer, add_to_server
from relayrl.weightsync.state import StateError

logger = logging.getLogger(__name__)

SERVICE_FULL_NAME = "relayrl.proto.weightsync.v1.WeightSync"


class GatewayControl:
    """weight-sync's calls to the rollout-gateway: pause the replicas it routes to, and route
    to a replica again once it holds a version. Each waits for a restarting gateway within
    its deadline (`wait_for_ready`); a gateway that stays away fails the call."""

    def __init__(self, config: Any) -> None:
        from relayrl.core.grpc_client import channel_from_config
        from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc

        self._pb = rollout_pb2
        self._timeout_s = config.default_timeout_s
        self._channel = channel_from_config(config, label="gateway")
        self._stub = rollout_pb2_grpc.RolloutGatewayStub(self._channel)

    async def pause(self, mode: str, replica_ids: Sequence[str] = ()) -> list[str]:
        """Pauses `replica_ids` (all when empty); the ids the gateway paused."""
        modes = {
            "abort": self._pb.PAUSE_MODE_ABORT,
            "keep": self._pb.PAUSE_MODE_KEEP,
            "wait": self._pb.PAUSE_MODE_WAIT,
        }
        reply = await self._stub.PauseReplicas(
            self._pb.PauseReplicasRequest(mode=modes[mode], replica_ids=list(replica_ids)),
            timeout=self._timeout_s,
            wait_for_ready=True,
        )
        return list(reply.paused_replica_ids)

    async def resume(self, replica_id: str, version: int) -> bool:
        """Routes to `replica_id` again, labelled `version` (its prefix cache reset); False
        when the gateway does not know the replica (it left, or the gateway restarted and has
        not discovered it yet: it registers it again then)."""
        from relayrl.proto.common.v1 import common_pb2

        request = self._pb.ResumeReplicasRequest(
            replica_ids=[replica_id], version=common_pb2.WeightVersion(version=version)
        )
        try:
            await self._stub.ResumeReplicas(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def hold(self, replica_id: str, reason: str) -> None:
        """Keeps `replica_id` out of routing until a resume names a version (its model may be
        a mix of two versions); a replica the gateway does not know is not an error."""
        request = self._pb.DrainReplicaRequest(
            replica_id=replica_id, reason=reason[:500], until_loaded=True
        )
        try:
            await self._stub.DrainReplica(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def close(self) -> None:
        await self._channel.close()


def engine_clients(http: EngineHttpConfig, token: str | None) -> Any:
    """The factory of clients of the engines, bounded by `http` and calling with weight-sync's
    engine token; a client's `rpc_timeout_s` bounds its worker RPCs (a load, a ping)."""
    from relayrl.inference.client import VllmEngineClient

    def engine_client(url: str, rpc_timeout_s: float) -> Any:
        return VllmEngineClient(url, http=http, rpc_timeout_s=rpc_timeout_s, token=token)

    return engine_client


class WeightSyncApp:
    def __init__(self, config: WeightSyncConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = WeightSyncMetrics(registry)
        self.gateway = GatewayControl(config.gateway) if config.gateway is not None else None
        self.service: GrpcService | None = None
        self.coordinator = Coordinator(
            config,
            self.metrics,
            engine_factory=engine_clients(
                config.engines.http, load_client_token(config.engines, "engines")
            ),
            gateway=self.gateway,
            advertise_target=self.advertise_target,
        )
        self.servicer = WeightSyncServicer(self.coordinator, chunk_bytes=config.chunk_size_bytes)

    def advertise_target(self) -> str:
        if self.config.advertise_target:
            return self.config.advertise_target
        assert self.service is not None
        host = self.config.grpc.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return f"{host}:{self.service.port}"

    async def close(self) -> None:
        await self.coordinator.close()
        if self.gateway is not None:
            await self.gateway.close()


async def run(config: WeightSyncConfig, ready_file: Path | None = None) -> None:
    registry = CollectorRegistry()
    app = WeightSyncApp(config, registry)
    service = build_service(
        config,
        service_name="weightsync",
        register=[lambda server: add_to_server(app.servicer, server)],
        service_names=[SERVICE_FULL_NAME],
        registry=registry,
        access=[WEIGHTSYNC_ACCESS],
        minted=app.coordinator.pull_tokens,
        shutdown_hooks=[app.close],
    )
    app.service = service

    def started(service: GrpcService) -> None:
        logger.info(
            "weight-sync ready: gRPC %s, metrics port %s, engines %s",
            service.address,
            service.metrics_port,
            ", ".join(config.engines.urls) or "(registered by the gateway)",
        )
        app.coordinator.start()  # needs the bound port: engines pull from it
        if ready_file is not None:
            write_ready_file(ready_file, service)

    try:
        await service.run_until_signal(on_started=started)
    except BaseException:
        await app.close()
        raise


def serve(config: WeightSyncConfig, ready_file: Path | None = None) -> int:
    # a taken port, or a state_dir that cannot be used: one line, not a traceback
    errors = (OSError, StateError)
    return serve_process(config, "weightsync", lambda: run(config, ready_file), errors)
