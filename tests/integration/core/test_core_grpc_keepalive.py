"""A gRPC peer that goes silent under a long call is noticed by keepalive within
`time_s + timeout_s`, long before the call's deadline (docs/recovery.md#silent-peers)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from relayrl.core.config import GrpcKeepaliveConfig, GrpcServerConfig
from relayrl.core.grpc_client import make_channel
from relayrl.core.grpc_server import GrpcService
from relayrl_testkit.helpers.silent_peer import BlackHoleProxy

SERVICE = "relayrl.coretest.v1.Keepalive"
KEEPALIVE = GrpcKeepaliveConfig(time_s=1.0, timeout_s=1.0)
SLACK_S = 1.0


async def sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(float(request))
    return b"slept"


def register(server: grpc.aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(
        sleep, request_deserializer=bytes, response_serializer=bytes
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"Sleep": handler})]
    )


def test_a_peer_that_goes_silent_under_a_long_call_fails_it_within_the_keepalive_bound() -> None:
    async def scenario() -> float:
        service = GrpcService(
            # the test's pings come every second: the server must accept them
            GrpcServerConfig(grace_s=0.1, min_ping_interval_s=0.5),
            service_name="coretest",
            register=[register],
            service_names=[SERVICE],
            registry=CollectorRegistry(),
        )
        async with service:
            with BlackHoleProxy(service.port) as proxy:
                channel = make_channel(proxy.address, keepalive=KEEPALIVE, default_timeout_s=20)
                async with channel:
                    call = channel.unary_unary(f"/{SERVICE}/Sleep")
                    assert await call(b"0") == b"slept"
                    waiting = asyncio.ensure_future(call(b"30"))
                    # Past two pings without data from the client: gRPC's default would stop
                    # pinging here, and the silence below would go unnoticed until the deadline.
                    await asyncio.sleep(2.5 * KEEPALIVE.time_s)
                    assert not waiting.done()
                    proxy.go_silent()
                    silent_at = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await waiting
                    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
                    return time.monotonic() - silent_at

    noticed_after_s = asyncio.run(scenario())
    assert noticed_after_s < KEEPALIVE.silent_peer_s + SLACK_S
