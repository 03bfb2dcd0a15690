"""Configuration of relayrl-trainer."""

from __future__ import annotations

from pydantic import Field

from relayrl.core.config import ServiceConfig
from relayrl.tq.config import TQConfig


class TrainerConfig(ServiceConfig):
    """trainer: samples scored groups from the TransferQueue and trains the policy."""

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
