"""Configuration of a TransferQueue client (shared by every service)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from relayrl.core.config import StrictModel, TlsClientConfig
from relayrl.tq.codec import check_partition_name


def _check_partition_names(names: list[str]) -> list[str]:
    for name in names:
        check_partition_name(name)
    return names


# A list of partition names, each checked as the TransferQueue would (shared by every config
# that names partitions).
PartitionNames = Annotated[list[str], AfterValidator(_check_partition_names)]


class TQConfig(StrictModel):
    """Where the TransferQueue lives and how it is used. Every service that touches the queue
    has this section (`tq:`) in its config."""

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL (redis:// or rediss://; a password goes in the URL or in "
        "password_env).",
    )
    password_env: str | None = Field(
        None, description="Name of an environment variable holding the Redis password."
    )
    tls: TlsClientConfig | None = Field(
        None,
        description="TLS towards Redis (a rediss:// URL): the CA its certificate must chain "
        "to, and a client certificate when Redis asks for one (tls-auth-clients). Null with "
        "rediss://: the system's CAs.",
    )
    namespace: str = Field(
        "relayrl",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Key prefix; runs that share one Redis use different namespaces. Every key "
        "is hash-tagged with it, so a Redis Cluster keeps a namespace on one shard.",
    )
    partitions: PartitionNames = Field(
        default_factory=lambda: ["train", "val"],
        description="Partitions this service creates on start (create_partition is idempotent).",
    )
    max_value_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        le=512 * 1024 * 1024,
        description="Largest serialised group, trajectory or reward accepted; larger payloads "
        "belong in attachments (by reference).",
    )
    event_stream_max_len: int = Field(
        1_000_000,
        ge=1000,
        description="Length beyond which each partition's event stream is trimmed of its "
        "oldest entries -- never of one a consumer group has not acknowledged: the stream then "
        "grows instead (the tq_event_stream_entries gauge shows it).",
    )
    durability: Literal["everysec", "always", "off"] = Field(
        "everysec",
        description="AOF fsync policy the queue expects of its Redis (appendonly yes + "
        "appendfsync). `always` fsyncs every transition before acknowledging it; `everysec` "
        "may lose up to ~1 s (2 s on a slow disk) of acknowledged transitions on a machine "
        "crash. Services refuse to start against a Redis that does not match; `off` accepts "
        "any Redis (a restart of it may lose the whole queue: for throwaway runs only).",
    )
    socket_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest wait for Redis to answer one command: a Redis that went silent "
        "(a partition, a half-open connection, a hung server) fails the command as unavailable "
        "within it, and the caller retries on a new connection. It must exceed the block of "
        "every blocking read made on the connection (a longer block is refused).",
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, le=600, description="Longest wait for a connection to Redis to open."
    )
    max_connections: int = Field(
        64,
        ge=2,
        le=10_000,
        description="Connections an asyncio client (the gateway, the reward-service) opens to "
        "Redis at most; a command waits for a free one up to socket_timeout_s. Each blocking "
        "read holds one for its block, so there are always at least two.",
    )
    health_check_interval_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="A pooled connection idle for this long is checked with a PING before its "
        "next command, so one that died while idle (a restarted Redis, a proxy that dropped "
        "it) fails the PING instead of the command; 0: never checked.",
    )

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> TQConfig:
        if self.tls is not None:
            if not self.url.startswith("rediss://"):
                raise ValueError("tls needs a rediss:// url (redis:// is plaintext)")
            if self.tls.server_name is not None:
                raise ValueError(
                    "tls.server_name is not supported for Redis: put the name its certificate "
                    "carries in the url"
                )
        return self
