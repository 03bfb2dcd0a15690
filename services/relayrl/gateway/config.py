"""Configuration of relayrl-gateway (the rollout-gateway)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from relayrl.core.config import ServiceConfig, StrictModel
from relayrl.tq.codec import check_partition_name
from relayrl.tq.config import TQConfig


class EnginesConfig(StrictModel):
    """The engine replicas to route to (`relayrl engine` servers)."""

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the replicas, e.g. http://engine-0.engine:8000.",
    )
    health_interval_s: float = Field(
        5.0, gt=0.0, le=3600.0, description="Interval of each replica's health check."
    )
    unhealthy_after: int = Field(
        2, ge=1, le=100, description="Failed checks in a row that take a replica out of routing."
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="Longest one generate call may take before its rollout fails as infra.",
    )
    initial_weight_version: int = Field(
        0,
        ge=0,
        description="Version label given at registration to a replica that has none yet "
        "(vLLM starts as 'default'); weight-sync sets the real ones.",
    )

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        if len(set(urls)) != len(urls):
            raise ValueError("engine URLs must be distinct")
        return urls


class RolloutConfig(StrictModel):
    """How prompt groups become trajectories."""

    partitions: list[str] = Field(
        default_factory=lambda: ["train"], description="Partitions to claim prompt groups from."
    )
    eta: float = Field(
        0.0,
        ge=0.0,
        le=64.0,
        description="Staleness bound: launched < (v + 1 + eta) * batch_size; 0 is synchronous.",
    )
    batch_size: int = Field(
        8,
        ge=1,
        le=1_000_000,
        description="Prompt groups per trainer step (until the trainer says).",
    )
    lease_s: float = Field(
        120.0, gt=0.0, le=86_400.0, description="Claim lease; renewed while a group runs."
    )
    max_inflight_groups: int = Field(
        64, ge=1, le=1_000_000, description="Groups this gateway rolls out at once."
    )
    claimer: str | None = Field(
        None, description="This gateway's claimer name; null: <hostname>-<pid>."
    )
    default_agent: str = Field(
        "single_turn", min_length=1, description="Agent loop for groups that name none."
    )
    max_turns: int = Field(4, ge=1, le=1000, description="Default cap on agent turns.")
    max_response_tokens: int = Field(
        512, ge=1, le=1_000_000, description="Default budget of response tokens, all turns."
    )

    @field_validator("partitions")
    @classmethod
    def _partitions(cls, names: list[str]) -> list[str]:
        for name in names:
            check_partition_name(name)
        return names


class AgentsConfig(StrictModel):
    """Agent loops and tools beyond the built-ins (by dotted path, configured by the operator)."""

    loops: dict[str, str] = Field(
        default_factory=dict, description="Name -> `package.module:AgentLoopClass`."
    )
    tools: dict[str, str] = Field(
        default_factory=dict, description="Name -> `package.module:ToolClass`."
    )
    tool_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="A tool call running longer fails its rollout (infra)."
    )


class GatewayConfig(ServiceConfig):
    """rollout-gateway: claims prompt groups from the TransferQueue, rolls them out on engine
    replicas, and writes trajectories back."""

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
    tokenizer: Path | None = Field(
        None,
        description="Folder with the policy's tokenizer and chat template (the model folder); "
        "needed to render chat prompts and tool turns.",
    )
    engines: EnginesConfig = Field(default_factory=EnginesConfig, description="Engine replicas.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollouts.")
    agents: AgentsConfig = Field(default_factory=AgentsConfig, description="Agent loops, tools.")
