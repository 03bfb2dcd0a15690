"""How a client of an engine's HTTP API bounds a silent engine (`engines.http:` of the gateway
and of weight-sync: one model, so both bound their engines alike)."""

from __future__ import annotations

from pydantic import Field

from relayrl.core.config import HttpLinkConfig


class EngineHttpConfig(HttpLinkConfig):
    """The bounds of every call to an engine that is not a long operation of its own: opening
    the connection, a control call, a health check, and TCP keepalive under all of them. A
    generation is bounded by its own deadline (the gateway's engines.request_timeout_s), a
    weight load by weight-sync's engines.load_timeout_s; keepalive still notices a silent
    engine under either within tcp_keepalive's bound (docs/recovery.md#silent-peers)."""

    control_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Deadline of one control call (pause, resume, reset_prefix_cache, the "
        "weight-version label, abort); a pause that waits for generations to finish has the "
        "generation's deadline instead.",
    )
    health_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="Deadline of one health check; the gateway takes a replica out of routing "
        "after engines.unhealthy_after failed checks in a row.",
    )
