"""Every gRPC client and server is built with the keepalive its config says, and with the
arguments that make gRPC honour it (docs/recovery.md#silent-peers)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from relayrl.core.config import GrpcClientConfig, GrpcKeepaliveConfig, GrpcServerConfig
from relayrl.core.grpc_client import channel_from_config, channel_options
from relayrl.core.grpc_server import server_options

KEEPALIVE = GrpcKeepaliveConfig(time_s=7.0, timeout_s=3.0)


def assert_keepalive(options: list[tuple[str, Any]], keepalive: GrpcKeepaliveConfig) -> None:
    given = dict(options)
    assert given["grpc.keepalive_time_ms"] == keepalive.time_s * 1000
    assert given["grpc.keepalive_timeout_ms"] == keepalive.timeout_s * 1000
    # gRPC times a keepalive ping out by the HTTP/2 ping timeout, and stops pinging a peer
    # that sends nothing after two pings unless told otherwise.
    assert given["grpc.http2.ping_timeout_ms"] == keepalive.timeout_s * 1000
    assert given["grpc.http2.max_pings_without_data"] == 0


def test_a_channel_without_a_keepalive_section_gets_the_default_one() -> None:
    assert_keepalive(channel_options(), GrpcKeepaliveConfig())


def test_server_options_carry_the_servers_keepalive() -> None:
    config = GrpcServerConfig(keepalive=KEEPALIVE, min_ping_interval_s=5)
    options = server_options(config)
    assert_keepalive(options, KEEPALIVE)
    assert dict(options)["grpc.http2.min_ping_interval_without_data_ms"] == 5000


def test_default_clients_ping_no_faster_than_default_servers_accept() -> None:
    assert GrpcClientConfig(target="x:1").keepalive.time_s >= GrpcServerConfig().min_ping_interval_s


def recording(seen: dict[str, Any]) -> Any:
    """A stand-in for sync_channel that keeps the options and connects nowhere."""

    def sync_channel(target: str, identity: Any, options: Any) -> grpc.Channel:
        seen["options"] = options
        return grpc.insecure_channel(target)

    return sync_channel


def test_channel_from_config_applies_the_sections_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def insecure_channel(target: str, options: Any, interceptors: Any) -> str:
        seen["options"] = options
        return "channel"

    monkeypatch.setattr(grpc.aio, "insecure_channel", insecure_channel)
    channel_from_config(GrpcClientConfig(target="peer:50051", keepalive=KEEPALIVE))
    assert_keepalive(seen["options"], KEEPALIVE)


def test_trainer_gateway_link_applies_the_sections_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relayrl.trainer import rollout_link

    seen: dict[str, Any] = {}
    monkeypatch.setattr(rollout_link, "sync_channel", recording(seen))
    link = rollout_link.GatewayLink(GrpcClientConfig(target="gateway:50051", keepalive=KEEPALIVE))
    link.close()
    assert_keepalive(seen["options"], KEEPALIVE)


def test_trainer_publisher_applies_the_publish_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.core import grpc_client
    from relayrl.trainer.config import WeightSyncPublishConfig
    from relayrl.trainer.publish import WeightSyncPublisher

    seen: dict[str, Any] = {}
    monkeypatch.setattr(grpc_client, "sync_channel", recording(seen))
    settings = WeightSyncPublishConfig(type="weightsync", target="ws:1", keepalive=KEEPALIVE)
    WeightSyncPublisher(settings, hf_dir=None)._connect().close()  # type: ignore[arg-type]
    assert_keepalive(seen["options"], KEEPALIVE)
