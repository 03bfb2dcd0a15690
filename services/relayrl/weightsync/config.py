"""Configuration of relayrl-weightsync."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from relayrl.core.config import MIB, GrpcClientConfig, ServiceConfig, StrictModel, TokenSourceConfig
from relayrl.inference.config import EngineHttpConfig


class WeightSyncEnginesConfig(TokenSourceConfig):
    """The engine replicas a version goes to, called with this section's token when the
    engines check their callers (relayrl.engine.guard)."""

    urls: list[str] = Field(
        default_factory=list,
        description="Engine base URLs (http://host:port) driven without a gateway, named "
        "engine-<index> in list order (as the gateway names the same list). With a gateway, "
        "leave it empty: the gateway registers every replica it discovers (RegisterEngine).",
    )
    load_timeout_s: float = Field(
        300.0, gt=0, description="Deadline for one replica to receive and load a version."
    )
    http: EngineHttpConfig = Field(
        default_factory=EngineHttpConfig,
        description="How a silent replica is noticed: connect and control-call deadlines, and "
        "TCP keepalive under every call, a load's included.",
    )
    attempts: int = Field(
        3,
        ge=1,
        le=10,
        description="Tries per replica and version; a replica that fails them all stays out "
        "of routing until it is brought to the committed version (the version commits on "
        "the replicas that loaded it).",
    )
    retry_backoff_s: float = Field(
        2.0,
        ge=0,
        le=600,
        description="Wait before the second try of a replica, doubled before each later one: "
        "an engine that is restarting gets the time to come back.",
    )
    registration_ttl_s: float = Field(
        10.0,
        gt=0,
        description="A replica registered over gRPC takes part in version switches while its "
        "last registration is this recent (the gateway registers its healthy replicas every "
        "engines.register_interval_s); a replica whose gateway stopped registering it (it is "
        "unhealthy or gone) is not waited for.",
    )


class DataPlaneConfig(StrictModel):
    """How buckets go from this service to the engines' workers (senders always push to the
    service over gRPC; the service keeps the version in host memory and fans it out)."""

    transport: Literal["grpc", "shm", "torch_distributed", "mooncake"] = Field(
        "grpc",
        description="grpc: every worker pulls the buckets over gRPC streaming (always works). "
        "shm: senders and workers on this service's host write and read each bucket in a "
        "shared-memory file (shm_dir), the others push and pull over gRPC as with grpc. "
        "torch_distributed: one broadcast per bucket from this service to every worker of every "
        "replica (gloo on CPU, nccl with device cuda). mooncake: the Mooncake transfer engine "
        "writes each bucket into every worker's registered buffers (TCP, or RDMA).",
    )
    cut_through: bool = Field(
        True,
        description="grpc and shm: the switch starts when a version's first bucket arrives and "
        "workers pull each bucket as soon as it is here, so the push and the pull overlap (a "
        "version reaches the engines sooner, but their pause also covers the rest of the "
        "push); false: the switch starts once the whole version is here. The broadcast data "
        "planes always send a complete version.",
    )
    shm_dir: Path = Field(
        Path("/dev/shm"),
        description="shm only: the tmpfs under which this service keeps its buckets (a folder "
        "of its own, mode 0700, removed when it stops).",
    )
    host: str | None = Field(
        None,
        description="Address at which engine workers reach this service's rendezvous store "
        "(torch_distributed, mooncake); null: the host of advertise_target.",
    )
    rendezvous_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the per-transfer rendezvous store; 0 picks a free one per transfer "
        "(set a fixed, exposed port in a pod).",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline of every single data-plane wait (peers joining, one bucket, the "
        "final confirmation); a dead or hung worker fails the attempt within it.",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where workers receive buckets: cpu (gloo, Mooncake TCP) or cuda."
    )
    mooncake_protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="Mooncake's transport protocol: tcp (anywhere) or rdma (RDMA NICs)."
    )
    mooncake_device_name: str = Field(
        "", description="Mooncake RDMA device filter (comma-separated); empty: discover them."
    )


class WeightSyncConfig(ServiceConfig):
    """weight-sync: plans and coordinates moving each new policy version into every engine."""

    bucket_size_bytes: int = Field(
        64 * MIB,
        ge=4096,
        le=4096 * MIB,
        description="Size of one transfer bucket; a receiver holds at most two beyond the model.",
    )
    chunk_size_bytes: int = Field(
        4 * MIB,
        ge=1024,
        le=64 * MIB,
        description="gRPC message size of one bucket chunk (under grpc.max_message_bytes).",
    )
    advertise_target: str | None = Field(
        None,
        description="gRPC target at which engines reach this service to pull buckets; null: "
        "grpc.host and the bound port (fine on one machine; set the Service DNS name in a pod).",
    )
    engines: WeightSyncEnginesConfig = Field(default_factory=WeightSyncEnginesConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    gateway: GrpcClientConfig | None = Field(
        None,
        description="The rollout-gateway: paused for the switch, resumed at the new version, "
        "told to drain a replica that cannot load. Null: engines are driven directly.",
    )
    pause_mode: Literal["abort", "keep", "wait"] = Field(
        "keep",
        description="How in-flight generations meet a switch: keep (frozen, continued on the "
        "new weights), abort (re-submitted by the gateway), wait (finish first).",
    )
    transfer_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A transfer whose buckets have not all arrived by then fails (no hang).",
    )
    metrics_log: Path | None = Field(
        None,
        description="JSONL file that receives one record per finished transfer: version, "
        "state, bytes, data plane, replicas and the seconds spent at each boundary.",
    )
    state_dir: Path | None = Field(
        None,
        description="Folder (a persistent volume in a cluster) where the committed version is "
        "kept, written before the commit is announced: a restarted weight-sync reads it back "
        "(checksummed) and still brings new engines to it. Null: the committed version lives "
        "in memory only, and a restarted weight-sync knows none (a warning at start).",
    )

    @model_validator(mode="after")
    def _chunks_fit(self) -> WeightSyncConfig:
        if self.chunk_size_bytes + 64 * 1024 > self.grpc.max_message_bytes:
            raise ValueError(
                f"chunk_size_bytes ({self.chunk_size_bytes}) must leave room under "
                f"grpc.max_message_bytes ({self.grpc.max_message_bytes})"
            )
        return self
