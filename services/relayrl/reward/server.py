"""`relayrl-reward` main: build the managers, the pipeline and the two front doors (gRPC for
any team, the TransferQueue scorer for the RL pipeline), serve until SIGTERM.

Shutdown order (hooks run newest first): the gRPC server stops accepting and drains its calls,
then the TransferQueue scorer stops reading (unacknowledged events are redelivered), then the
pipeline scores what it holds for `shutdown_grace_s` and closes the managers.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import CollectorRegistry

from relayrl.core.access import REWARD_ACCESS
from relayrl.core.grpc_server import GrpcService, build_service, serve_process, write_ready_file
from relayrl.proto.reward.v1 import reward_pb2, reward_pb2_grpc
from relayrl.reward.config import RewardConfig
from relayrl.reward.managers.table import build_managers
from relayrl.reward.metrics import RewardMetrics
from relayrl.reward.pipeline import PipelineSettings, RewardPipeline
from relayrl.reward.quotas import RedisQuotas
from relayrl.reward.servicer import RewardServicer
from relayrl.reward.tenants import Tenants
from relayrl.tq.queue import DurabilityError, TQUnavailableError

logger = logging.getLogger(__name__)

SERVICE_FULL_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


def pipeline_settings(config: RewardConfig) -> PipelineSettings:
    pipeline = config.pipeline
    return PipelineSettings(
        num_workers=pipeline.num_workers,
        backlog_max_items=pipeline.backlog.max_items,
        backlog_mode=pipeline.backlog.mode,
        batching=pipeline.batching,
        max_items_per_request=pipeline.max_items_per_request,
        handle_ttl_s=pipeline.handle_ttl_s,
        collected_retention_s=pipeline.collected_retention_s,
    )


class RewardApp:
    """The reward-service's components, wired; no gRPC server in it (tests and the load
    benchmark drive it in-process too)."""

    def __init__(self, config: RewardConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = RewardMetrics(registry)
        managers = build_managers(config.managers, registry)
        self.pipeline = RewardPipeline(
            managers,
            pipeline_settings(config),
            self.metrics,
            batching={n: m.batching for n, m in config.managers.items() if m.batching},
            timeouts_s={n: m.timeout_s for n, m in config.managers.items()},
        )
        self.tenants = Tenants(
            config, self.metrics, RedisQuotas(config.tq) if config.quota_store == "redis" else None
        )
        self.servicer = RewardServicer(self.pipeline, self.tenants, config)
        self._tq_scorer = None
        self._tq = None
        self._closed = False

    async def start(self) -> None:
        await self.pipeline.start()
        if self.config.tq_scorer.enabled:
            from relayrl.reward.tq_scorer import TQScorer
            from relayrl.tq import AsyncTransferQueue

            # No partitions here: creating them needs Redis, which may come up after us; the
            # scorer's readers create theirs, retrying until Redis answers.
            self._tq = AsyncTransferQueue.from_config(
                self.config.tq.model_copy(update={"partitions": []})
            )
            try:  # a Redis without AOF: refuse to start (the scorer checks again on joining)
                await self._tq.check_durability()
            except TQUnavailableError as exc:
                logger.info("TransferQueue not reachable yet (%s): checked on joining", exc)
            self._tq_scorer = TQScorer(
                self._tq, self.pipeline, self.config.tq_scorer, self.config.default_manager
            )
            await self._tq_scorer.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tq_scorer is not None:
            await self._tq_scorer.close()
        await self.pipeline.close(self.config.pipeline.shutdown_grace_s)
        await self.tenants.close()
        if self._tq is not None:
            await self._tq.aclose()


async def run(config: RewardConfig, ready_file: Path | None = None) -> None:
    registry = CollectorRegistry()
    app = RewardApp(config, registry)
    await app.start()
    service = build_service(
        config,
        service_name="reward",
        register=[
            lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(app.servicer, server)
        ],
        service_names=[SERVICE_FULL_NAME],
        registry=registry,
        access=[REWARD_ACCESS],
        shutdown_hooks=[app.close],
    )

    def started(service: GrpcService) -> None:
        logger.info(
            "reward-service ready: gRPC %s, metrics port %s, managers %s",
            service.address,
            service.metrics_port,
            ", ".join(sorted(config.managers)),
        )
        if ready_file is not None:
            write_ready_file(ready_file, service)

    try:
        await service.run_until_signal(on_started=started)
    except BaseException:
        await app.close()
        raise


def serve(config: RewardConfig, ready_file: Path | None = None) -> int:
    errors = (OSError, DurabilityError)  # a taken port, a Redis without AOF: one line
    return serve_process(config, "reward", lambda: run(config, ready_file), errors)
