"""Configuration of relayrl-weightsync."""

from __future__ import annotations

from relayrl.core.config import ServiceConfig


class WeightSyncConfig(ServiceConfig):
    """weight-sync: plans and coordinates moving each new policy version into every engine."""
