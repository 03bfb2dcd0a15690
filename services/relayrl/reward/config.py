"""Configuration of relayrl-reward (the reward-service)."""

from __future__ import annotations

from pydantic import Field

from relayrl.core.config import ServiceConfig
from relayrl.tq.config import TQConfig


class RewardConfig(ServiceConfig):
    """reward-service: scores items over gRPC for any team, and trajectories as they land in
    the TransferQueue."""

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
