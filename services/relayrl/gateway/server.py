"""`relayrl-gateway` main: the replica pool, one rollout loop per partition, the agent HTTP
endpoint for black-box agents, the gRPC control plane; serve until SIGTERM (then abort open
agent sessions, stop claiming, cancel running groups: their claims expire and return to pending
with the trajectories already written)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from prometheus_client import CollectorRegistry

from relayrl.conversation.tools import ToolTable
from relayrl.core.access import GATEWAY_ACCESS
from relayrl.core.config import ConfigError, load_client_token
from relayrl.core.grpc_server import GrpcService, build_service, serve_process, write_ready_file
from relayrl.core.interceptors import build_authenticator, roles_function
from relayrl.core.replicas import static_replica_ids
from relayrl.gateway.agent_http import AgentHttpServer, AgentSessions
from relayrl.gateway.agent_http.access import AgentAccess
from relayrl.gateway.agents import AgentContext, build_agent_loops
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.discovery import EndpointSliceDiscovery
from relayrl.gateway.external_agent import ExternalAgent
from relayrl.gateway.metrics import GatewayMetrics
from relayrl.gateway.registration import WeightSyncRegistrar
from relayrl.gateway.replicas import Replica, ReplicaPool
from relayrl.gateway.rollout import LeaseSweeper, RolloutWorker, Throttle
from relayrl.gateway.servicer import RolloutGatewayServicer
from relayrl.inference.client import SamplingOptions, VllmEngineClient
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from relayrl.tq.queue import DurabilityError

logger = logging.getLogger(__name__)

SERVICE_FULL_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutGateway"].full_name


def sampling_for(
    group: common_pb2.PromptGroup, index: int, config: GatewayConfig
) -> SamplingOptions:
    """The group's SamplingParams for sample `index` (seed + index, so the n samples of a
    group differ yet a retried sample repeats). temperature is taken as given (0 = greedy)."""
    params = group.sampling
    return SamplingOptions(
        max_tokens=params.max_response_tokens or config.rollout_shape.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=params.seed + index if params.seed else None,
    )


class GatewayApp:
    """The gateway's components, wired (no gRPC server in it)."""

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None) -> None:
        if config.tokenizer is None:
            raise ValueError("tokenizer: set the folder of the policy's tokenizer (the model)")
        from transformers import AutoTokenizer

        from relayrl.tq import AsyncTransferQueue

        self.config = config
        self._engine_token = load_client_token(config.engines, "engines")
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.tools = ToolTable(config.agents.tools, timeout_s=config.agents.tool_timeout_s)
        self.loops = build_agent_loops(config.agents.loops)
        engines = config.engines
        self.metrics = GatewayMetrics(registry or CollectorRegistry())
        self.registrar: WeightSyncRegistrar | None = None
        self.pool = ReplicaPool(
            health_interval_s=engines.health_interval_s,
            unhealthy_after=engines.unhealthy_after,
            metrics=self.metrics,
            gated=config.weightsync is not None,
            on_change=self._replica_changed,
        )
        if config.weightsync is not None:
            self.registrar = WeightSyncRegistrar(
                self.pool, config.weightsync, engines.register_interval_s
            )
        self.discovery = (
            EndpointSliceDiscovery(self.pool, engines.kubernetes, make_client=self.engine_client)
            if engines.kubernetes
            else None
        )
        self.tq = AsyncTransferQueue.from_config(config.tq.model_copy(update={"partitions": []}))
        claimer = config.rollout.claimer or f"{socket.gethostname()}-{os.getpid()}"
        self.workers = [
            RolloutWorker(
                self.tq,
                self.pool,
                self.loops,
                self.context_for,
                partition=partition,
                claimer=claimer,
                throttle=Throttle(0, config.rollout_shape.batch_groups, config.rollout_shape.eta),
                lease_s=config.rollout.lease_s,
                max_inflight_groups=config.rollout.max_inflight_groups,
                request_timeout_s=engines.request_timeout_s,
                default_agent=config.rollout.default_agent,
            )
            for partition in config.rollout.partitions
        ]
        self.sessions: AgentSessions | None = None
        self.agent_http: AgentHttpServer | None = None
        if config.agent_http.enabled:
            self.sessions = AgentSessions(
                tq=self.tq,
                pool=self.pool,
                tokenizer=self.tokenizer,
                config=config.agent_http,
                claimer=claimer,
                lease_s=config.rollout.lease_s,
                request_timeout_s=engines.request_timeout_s,
                policy_step=self.policy_step,
            )
            self.agent_http = AgentHttpServer(
                self.sessions, config.agent_http, self._agent_access(self.sessions)
            )
            for name, agent in config.agents.external.items():
                if name in self.loops:
                    raise ConfigError(
                        f"agents.external.{name}: a built-in agent loop has that name"
                    )
                self.loops[name] = ExternalAgent(name, agent, self.sessions, self.agent_endpoint)
        served = list(config.rollout.partitions)
        if config.agent_http.enabled:
            served.append(config.agent_http.partition)
        self.sweeper = LeaseSweeper(self.tq, served, config.rollout.lease_s, self._requeued)
        self.servicer = RolloutGatewayServicer(
            self.pool, self.workers, self.sessions, agent_http_port=self.agent_http_port
        )

    def _replica_changed(self, replica: Replica) -> None:
        if self.registrar is not None:
            self.registrar.poke(replica)

    def policy_step(self) -> int:
        """The trainer's step as last reported (UpdatePolicyStep), for ad-hoc agent groups."""
        return self.workers[0].throttle.policy_step if self.workers else 0

    def _requeued(self, partition: str, uids: list[str]) -> None:
        logger.warning(
            "%d groups on %s had an expired claim (their gateway stopped renewing it); "
            "returned to pending: %s",
            len(uids),
            partition,
            ", ".join(uids[:10]) + (" ..." if len(uids) > 10 else ""),
        )
        self.metrics.groups_requeued.labels(partition=partition).inc(len(uids))

    def agent_http_port(self) -> int:
        return self.agent_http.port if self.agent_http is not None else 0

    def agent_endpoint(self) -> str:
        """The agent endpoint's base URL as this gateway's own agent processes reach it."""
        host = self.config.agent_http.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self.agent_http_port()}"

    def context_for(self, group: common_pb2.PromptGroup, index: int) -> AgentContext:
        config = self.config
        return AgentContext(
            tokenizer=self.tokenizer,
            sampling=sampling_for(group, index, config),
            max_turns=group.sampling.max_turns or config.rollout.max_turns,
            max_response_tokens=group.sampling.max_response_tokens
            or config.rollout_shape.max_tokens,
            tools=self.tools,
        )

    def _agent_access(self, sessions: AgentSessions) -> AgentAccess | None:
        """With `auth:`, the agent endpoint checks the same callers as the gRPC service (an
        agent opens sessions with its token; each session gets its own)."""
        authenticator = build_authenticator(self.config.auth)
        if authenticator is None:
            return None
        return AgentAccess(authenticator, sessions.tokens, roles_function(self.config.auth))

    def engine_client(self, url: str) -> VllmEngineClient:
        """A client of the replica at `url`, calling with the gateway's engine token."""
        engines = self.config.engines
        return VllmEngineClient(
            url,
            http=engines.http,
            request_timeout_s=engines.request_timeout_s,
            token=self._engine_token,
        )

    async def start(self) -> None:
        initial = str(self.config.engines.initial_weight_version)
        for replica_id, url in static_replica_ids(self.config.engines.urls).items():
            replica = await self.pool.add(replica_id, self.engine_client(url))
            if replica.routable and not replica.weight_version.isdigit():  # not gated
                await replica.client.set_weight_version(initial)
                replica.weight_version = initial
        self.pool.start_health_checks()
        if self.registrar is not None:
            self.registrar.start()
        if self.discovery is not None:
            self.discovery.start()
        for partition in self.config.rollout.partitions:
            await self.tq.create_partition(partition)
        await self.tq.check_durability()  # refuse a Redis without AOF
        for worker in self.workers:
            worker.start()
        if self.sessions is not None and self.agent_http is not None:
            await self.sessions.start()
            await self.agent_http.start()
        self.sweeper.start()  # after every partition it sweeps exists

    async def close(self) -> None:
        # Open agent sessions first (their in-flight requests end at once), then the endpoint.
        if self.sessions is not None:
            await self.sessions.close()
        if self.agent_http is not None:
            await self.agent_http.stop()
        await self.sweeper.close()
        for worker in self.workers:
            await worker.close()
        for loop in self.loops.values():
            if isinstance(loop, ExternalAgent):
                await loop.close()  # a served agent's process
        if self.discovery is not None:
            await self.discovery.close()
        if self.registrar is not None:
            await self.registrar.close()
        await self.pool.close()
        await self.tq.aclose()


async def run(config: GatewayConfig, ready_file: Path | None = None) -> None:
    registry = CollectorRegistry()
    app = GatewayApp(config, registry)
    await app.start()
    service = build_service(
        config,
        service_name="gateway",
        register=[
            lambda server: rollout_pb2_grpc.add_RolloutGatewayServicer_to_server(
                app.servicer, server
            )
        ],
        service_names=[SERVICE_FULL_NAME],
        registry=registry,
        access=[GATEWAY_ACCESS],
        shutdown_hooks=[app.close],
    )

    def started(service: GrpcService) -> None:
        logger.info(
            "rollout-gateway ready: gRPC %s, agent HTTP port %d, %d engine replicas, partitions %s",
            service.address,
            app.agent_http_port(),
            len(app.pool.replicas),
            ", ".join(config.rollout.partitions),
        )
        if ready_file is not None:
            write_ready_file(ready_file, service, {"agent_http_port": app.agent_http_port()})

    await service.run_until_signal(on_started=started)


def serve(config: GatewayConfig, ready_file: Path | None = None) -> int:
    # a taken port or a missing tokenizer folder: one line, not a traceback
    errors = (OSError, ValueError, DurabilityError)
    return serve_process(config, "gateway", lambda: run(config, ready_file), errors)
