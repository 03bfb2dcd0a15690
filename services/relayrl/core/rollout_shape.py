"""The rollout shape: what the trainer (which issues prompt groups and trains on them) and the
gateway (which throttles and rolls them out) must agree on. Both services' configs embed this
one model under `rollout_shape:`, so its names and types cannot drift apart between them, and a
composition (relayrl.stack) derives it once for both."""

from __future__ import annotations

from pydantic import Field

from relayrl.core.config import StrictModel


class RolloutShape(StrictModel):
    """How much rollout one trainer step takes, and how far rollout may run ahead of it."""

    eta: int = Field(
        0,
        ge=0,
        le=64,
        description="Versions rollout may run ahead of training: the gateway launches a group "
        "only while launched < (v + 1 + eta) * batch_groups; 0 is synchronous.",
    )
    batch_groups: int = Field(
        8, ge=1, le=1_000_000, description="Prompt groups trained on per trainer step."
    )
    samples_per_prompt: int = Field(
        4, ge=1, le=1024, description="Trajectories per prompt group (the GRPO group)."
    )
    max_tokens: int = Field(
        512,
        ge=1,
        le=1_000_000,
        description="Response token budget per trajectory, all turns (a group's own budget, "
        "which the trainer's feeder sets from this, wins at the gateway).",
    )
