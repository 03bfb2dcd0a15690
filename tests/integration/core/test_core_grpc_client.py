"""Client bootstrap against a real server: the default deadline, request-id propagation and
retries of idempotent calls."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from prometheus_client import CollectorRegistry

from relayrl.core.config import GrpcClientConfig, GrpcServerConfig
from relayrl.core.grpc_client import RetryPolicy, call_idempotent, channel_from_config, make_channel
from relayrl.core.grpc_server import GrpcService
from relayrl.core.logs import REQUEST_ID, current_request_id

SERVICE = "relayrl.coretest.v1.Client"
FAST_RETRIES = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


class Servicer:
    """Sleep: sleeps for the number of seconds in the request. RequestId: returns the request
    id the server saw. Flaky: fails with the code named in the request until it has been
    called `fail_times` times for that request."""

    def __init__(self, fail_times: int) -> None:
        self.fail_times = fail_times
        self.attempts: collections.Counter[bytes] = collections.Counter()

    async def sleep(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(float(request))
        return b"slept"

    async def request_id(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return (current_request_id() or "-").encode()

    async def flaky(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.attempts[request] += 1
        if self.attempts[request] <= self.fail_times:
            await context.abort(grpc.StatusCode[request.decode()], "failing on purpose")
        return b"ok"

    def register(self, server: grpc.aio.Server) -> None:
        def unary(fn: object) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=bytes, response_serializer=bytes
            )

        handlers = {
            "Sleep": unary(self.sleep),
            "RequestId": unary(self.request_id),
            "Flaky": unary(self.flaky),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])


@asynccontextmanager
async def serving(
    servicer: Servicer, registry: CollectorRegistry, default_timeout_s: float
) -> AsyncIterator[grpc.aio.Channel]:
    service = GrpcService(
        GrpcServerConfig(grace_s=0.5),
        service_name="coretest",
        register=[servicer.register],
        service_names=[SERVICE],
        registry=registry,
    )
    async with (
        service,
        make_channel(f"127.0.0.1:{service.port}", default_timeout_s=default_timeout_s) as channel,
    ):
        yield channel


def test_call_without_deadline_gets_the_default_deadline() -> None:
    registry = CollectorRegistry()

    async def scenario() -> None:
        async with serving(Servicer(0), registry, default_timeout_s=0.3) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exceeded:
                await channel.unary_unary(method("Sleep"))(b"30")
            assert exceeded.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            # The server side sees the same outcome (recorded once the handler is cancelled).
            labels = {"method": method("Sleep"), "code": "DEADLINE_EXCEEDED"}
            for _ in range(200):
                if registry.get_sample_value("relayrl_coretest_grpc_requests_total", labels):
                    break
                await asyncio.sleep(0.05)
            assert registry.get_sample_value("relayrl_coretest_grpc_requests_total", labels) == 1

    asyncio.run(scenario())


def test_explicit_timeout_overrides_the_default() -> None:
    async def scenario() -> None:
        async with serving(Servicer(0), CollectorRegistry(), default_timeout_s=0.05) as channel:
            assert await channel.unary_unary(method("Sleep"))(b"0.3", timeout=30) == b"slept"

    asyncio.run(scenario())


def test_channel_from_config_applies_its_default_timeout() -> None:
    async def scenario() -> None:
        service = GrpcService(
            GrpcServerConfig(grace_s=0.5),
            service_name="coretest",
            register=[Servicer(0).register],
            service_names=[SERVICE],
            registry=CollectorRegistry(),
        )
        async with service:
            config = GrpcClientConfig(target=f"127.0.0.1:{service.port}", default_timeout_s=0.2)
            async with channel_from_config(config) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as exceeded:
                    await channel.unary_unary(method("Sleep"))(b"30")
                assert exceeded.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(scenario())


def test_request_id_of_the_current_call_is_propagated() -> None:
    async def scenario() -> None:
        async with serving(Servicer(0), CollectorRegistry(), default_timeout_s=20) as channel:
            request_id = channel.unary_unary(method("RequestId"))
            REQUEST_ID.set("upstream-call-42")
            assert await request_id(b"") == b"upstream-call-42"
            explicit = (("x-request-id", "explicit-1"),)
            assert await request_id(b"", metadata=explicit) == b"explicit-1"

    asyncio.run(scenario())


def test_idempotent_call_retries_unavailable_until_it_succeeds() -> None:
    servicer = Servicer(fail_times=2)

    async def scenario() -> bytes:
        async with serving(servicer, CollectorRegistry(), default_timeout_s=20) as channel:
            flaky = channel.unary_unary(method("Flaky"))
            return await call_idempotent(flaky, b"UNAVAILABLE", timeout_s=20, policy=FAST_RETRIES)

    assert asyncio.run(scenario()) == b"ok"
    assert servicer.attempts[b"UNAVAILABLE"] == 3


def test_idempotent_call_gives_up_after_max_attempts() -> None:
    servicer = Servicer(fail_times=100)

    async def scenario() -> grpc.StatusCode:
        async with serving(servicer, CollectorRegistry(), default_timeout_s=20) as channel:
            flaky = channel.unary_unary(method("Flaky"))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call_idempotent(flaky, b"UNAVAILABLE", timeout_s=20, policy=FAST_RETRIES)
            return failed.value.code()

    assert asyncio.run(scenario()) is grpc.StatusCode.UNAVAILABLE
    assert servicer.attempts[b"UNAVAILABLE"] == FAST_RETRIES.max_attempts


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "INTERNAL"])
def test_idempotent_call_does_not_retry_other_codes(code: str) -> None:
    servicer = Servicer(fail_times=1)

    async def scenario() -> grpc.StatusCode:
        async with serving(servicer, CollectorRegistry(), default_timeout_s=20) as channel:
            flaky = channel.unary_unary(method("Flaky"))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call_idempotent(flaky, code.encode(), timeout_s=20, policy=FAST_RETRIES)
            return failed.value.code()

    assert asyncio.run(scenario()) is grpc.StatusCode[code]
    assert servicer.attempts[code.encode()] == 1


def test_idempotent_call_stops_retrying_when_its_time_budget_is_spent() -> None:
    servicer = Servicer(fail_times=100)
    slow_backoff = RetryPolicy(max_attempts=50, initial_backoff_s=5.0, max_backoff_s=5.0)

    async def scenario() -> None:
        async with serving(servicer, CollectorRegistry(), default_timeout_s=20) as channel:
            flaky = channel.unary_unary(method("Flaky"))
            with pytest.raises(grpc.aio.AioRpcError):
                await call_idempotent(flaky, b"UNAVAILABLE", timeout_s=1.0, policy=slow_backoff)

    asyncio.run(scenario())
    # The first backoff (>= 2.5 s with jitter) does not fit into 1 s, so no retry happens.
    assert servicer.attempts[b"UNAVAILABLE"] == 1
