"""Configuration of relayrl-reward (the reward-service).

The operator configures named managers (`managers:`, each with a `type` from the closed
table); remote callers only choose among them by name. Tenants are the principals that
`auth:` establishes, each with quotas and the managers it may use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relayrl.core.config import ServiceConfig, StrictModel
from relayrl.reward.managers.base import BatchingConfig
from relayrl.reward.managers.naive import NaiveConfig
from relayrl.reward.managers.table import ManagerConfig, build_order
from relayrl.tq.config import PartitionNames, TQConfig

ANONYMOUS_TENANT = "anonymous"
PIPELINE_TENANT = "pipeline"


class BacklogConfig(StrictModel):
    """Back-pressure: how many items may be accepted and not yet finished."""

    max_items: int = Field(4096, ge=1, le=10_000_000, description="Backlog bound, in items.")
    mode: Literal["block", "drop_oldest"] = Field(
        "block",
        description="When full: block (the caller waits for room, up to its deadline, then "
        "gets RESOURCE_EXHAUSTED) or drop_oldest (the oldest queued items come back "
        "RATE_LIMITED to make room).",
    )


class ScoringPipelineConfig(StrictModel):
    """The scoring pipeline shared by every front door."""

    num_workers: int = Field(
        2,
        ge=1,
        le=4096,
        description="Backend calls each manager runs at once without micro-batching; a "
        "submission is split into min(num_workers, n) chunks.",
    )
    backlog: BacklogConfig = Field(default_factory=BacklogConfig, description="Back-pressure.")
    batching: BatchingConfig = Field(
        default_factory=BatchingConfig,
        description="Default micro-batching of managers that set none.",
    )
    default_on_error: Literal["raise", "mark"] = Field(
        "mark",
        description="on_error for requests that leave it unspecified: mark (failed items come "
        "back with their status) or raise (the call fails naming the item).",
    )
    max_items_per_request: int = Field(
        4096, ge=1, le=1_000_000, description="Most items in one Score or Submit call."
    )
    handle_ttl_s: float = Field(
        600.0,
        gt=0.0,
        le=7 * 86_400.0,
        description="A handle never collected is dropped this long after Submit.",
    )
    collected_retention_s: float = Field(
        60.0,
        ge=0.0,
        le=86_400.0,
        description="A collected handle stays readable this long, so a retried Collect works.",
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0.0,
        le=3600.0,
        description="On shutdown, how long queued and running items may finish; the rest come "
        "back INFRA_ERROR.",
    )


class TenantConfig(StrictModel):
    """One caller's limits. Quotas are token buckets refilled continuously."""

    requests_per_minute: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="Calls per minute (Score, Submit, Collect, each streamed item); null: "
        "unlimited.",
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=100_000_000_000,
        description="Tokens of submitted items per minute (response token ids, else ~4 "
        "characters per token); null: unlimited.",
    )
    managers: list[str] | None = Field(
        None, description="Managers this tenant may use; null: every configured one."
    )


class TQScorerConfig(StrictModel):
    """The TransferQueue path: score trajectories as they become `finished`."""

    enabled: bool = Field(False, description="Run the scorer (the RL pipeline's reward stage).")
    partitions: PartitionNames = Field(
        default_factory=lambda: ["train", "val"], description="Partitions whose events to score."
    )
    manager: str | None = Field(
        None, description="Manager for trajectories; null: default_manager."
    )
    managers_by_data_source: dict[str, str] = Field(
        default_factory=dict,
        description="Prompt-group data_source -> manager, overriding `manager` (e.g. code "
        "tasks to a sandbox).",
    )
    consumer_group: str = Field(
        "reward", min_length=1, description="Redis consumer group shared by every replica."
    )
    reader: str | None = Field(
        None,
        description="This replica's reader name in the group; null: <hostname>-<pid>. Keep it "
        "stable across restarts (the pod name) so a restarted replica resumes its own "
        "pending entries at once.",
    )
    read_count: int = Field(64, ge=1, le=10_000, description="Events read per Redis call.")
    max_inflight_items: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Trajectories being scored at once; reading pauses beyond this.",
    )
    reclaim_idle_s: float = Field(
        30.0,
        gt=0.0,
        le=86_400.0,
        description="Events left unacknowledged this long by a dead replica are taken over.",
    )
    max_deliveries: int = Field(
        5,
        ge=1,
        le=1000,
        description="An event delivered this often without being acknowledged goes to the "
        "dead-letter stream.",
    )


class RewardConfig(ServiceConfig):
    """reward-service: scores items over gRPC for any team, and trajectories as they land in
    the TransferQueue."""

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
    pipeline: ScoringPipelineConfig = Field(
        default_factory=ScoringPipelineConfig, description="Backlog, workers, default batching."
    )
    managers: dict[str, ManagerConfig] = Field(
        default_factory=lambda: {"naive": NaiveConfig(type="naive")},
        min_length=1,
        description="Configured managers by name; each has a `type` (naive, rate_limited, "
        "remote, genrm, disrm, dapo, gdpo, sandbox, sandbox_remote, reasoning_gym, env, custom).",
    )
    default_manager: str = Field(
        "naive", min_length=1, description="Manager used when a request names none."
    )
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description="Per-principal limits (principal names come from `auth:`).",
    )
    tenant_defaults: TenantConfig = Field(
        default_factory=TenantConfig,
        description="Limits of a principal without an entry in `tenants` (and of every caller "
        "when auth is none).",
    )
    quota_store: Literal["memory", "redis"] = Field(
        "memory",
        description="Where tenant quotas are counted: memory (this replica alone: N replicas "
        "give a tenant N times its quota) or redis (the `tq:` Redis, shared by every replica; "
        "what a deployment with more than one replica needs).",
    )
    tq_scorer: TQScorerConfig = Field(
        default_factory=TQScorerConfig, description="Scoring trajectories in the TransferQueue."
    )

    @field_validator("managers")
    @classmethod
    def _manager_names(cls, managers: dict[str, ManagerConfig]) -> dict[str, ManagerConfig]:
        for name in managers:
            if not name or len(name) > 64 or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"manager name {name!r}: use 1-64 letters, digits, '_' or '-'")
        build_order(managers)
        return managers

    @model_validator(mode="after")
    def _references(self) -> RewardConfig:
        known = set(self.managers)

        def check(field: str, names: list[str]) -> None:
            for name in names:
                if name not in known:
                    raise ValueError(
                        f"{field} names manager {name!r}, which is not configured "
                        f"(configured: {', '.join(sorted(known))})"
                    )

        check("default_manager", [self.default_manager])
        if self.tq_scorer.manager is not None:
            check("tq_scorer.manager", [self.tq_scorer.manager])
        by_source = self.tq_scorer.managers_by_data_source
        check("tq_scorer.managers_by_data_source", list(by_source.values()))
        check("tenant_defaults.managers", self.tenant_defaults.managers or [])
        for tenant, limits in self.tenants.items():
            check(f"tenants.{tenant}.managers", limits.managers or [])
        return self

    def tenant(self, principal: str) -> TenantConfig:
        return self.tenants.get(principal, self.tenant_defaults)
