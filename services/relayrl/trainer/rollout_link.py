"""The trainer's calls to the rollout-gateway: the policy step (the throttle's v) with the
refill credit, and pause/resume for colocated modes. Synchronous, because the training loop
runs in its own thread; every call has a deadline and UNAVAILABLE is retried (all three calls
are idempotent: they set state, they do not add to it)."""

from __future__ import annotations

import logging
import time

import grpc

from relayrl.core.config import GrpcClientConfig
from relayrl.core.grpc_client import ClientIdentity, channel_options, sync_channel
from relayrl.core.outage import Outage
from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc

logger = logging.getLogger(__name__)


class _Away(Exception):
    """The gateway did not answer (restarting, or gone for now)."""


class GatewayLink:
    def __init__(
        self, config: GrpcClientConfig, *, attempts: int = 5, outage_timeout_s: float = 600.0
    ) -> None:
        """`outage_timeout_s`: how long pause and resume (colocated modes: the step cannot go
        on without them) wait out a gateway that is away."""
        self._config = config
        self._attempts = attempts
        self._outage_timeout_s = outage_timeout_s
        self._channel = sync_channel(
            config.target,
            ClientIdentity.from_config(config, "gateway"),
            channel_options(max_message_bytes=config.max_message_bytes, keepalive=config.keepalive),
        )
        self._stub = rollout_pb2_grpc.RolloutGatewayStub(self._channel)

    def _call(self, method: str, request: object, attempts: int | None = None) -> object:
        attempts = attempts or self._attempts
        delay = 0.2
        for attempt in range(1, attempts + 1):
            try:
                return getattr(self._stub, method)(request, timeout=self._config.default_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == attempts:
                    raise
                logger.warning("gateway %s unavailable (%s); retrying", method, exc.details())
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def update_policy_step(
        self, policy_step: int, batch_size: int, refill_groups: int, *, attempts: int | None = None
    ) -> None:
        self._call(
            "UpdatePolicyStep",
            rollout_pb2.UpdatePolicyStepRequest(
                policy_step=policy_step, batch_size=batch_size, refill_groups=refill_groups
            ),
            attempts,
        )

    def _through_outage(self, method: str, request: object) -> None:
        """One idempotent call, waiting (within each deadline) for a restarting gateway and
        retrying a gateway that stays away for up to `outage_timeout_s`."""
        outage = Outage(f"the gateway at {self._config.target} ({method})", self._outage_timeout_s)

        def call() -> None:
            try:
                getattr(self._stub, method)(
                    request, timeout=self._config.default_timeout_s, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                if exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                raise _Away(f"{exc.code().name}: {exc.details()}") from None

        outage.call(call, (_Away,))

    def pause(self) -> None:
        self._through_outage(
            "PauseReplicas", rollout_pb2.PauseReplicasRequest(mode=rollout_pb2.PAUSE_MODE_KEEP)
        )

    def resume(self) -> None:
        self._through_outage("ResumeReplicas", rollout_pb2.ResumeReplicasRequest())

    def close(self) -> None:
        self._channel.close()
