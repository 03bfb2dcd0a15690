"""Configuration of relayrl-gateway (the rollout-gateway)."""

from __future__ import annotations

from pydantic import Field

from relayrl.core.config import ServiceConfig
from relayrl.tq.config import TQConfig


class GatewayConfig(ServiceConfig):
    """rollout-gateway: claims prompt groups from the TransferQueue, rolls them out on engine
    replicas, and writes trajectories back."""

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
