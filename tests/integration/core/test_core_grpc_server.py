"""The service bootstrap against a real grpc.aio server and channel on a free loopback port:
health, reflection, request ids, metrics (registry and HTTP), auth, and all four RPC kinds
through the full interceptor chain."""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from relayrl.core.config import GrpcServerConfig, MetricsConfig, ServiceConfig, load_config
from relayrl.core.grpc_client import make_channel
from relayrl.core.grpc_server import GrpcService, build_service
from relayrl.core.interceptors import (
    Authenticator,
    StaticTokenAuthenticator,
    current_principal,
)
from relayrl.core.logs import current_request_id

SERVICE = "relayrl.coretest.v1.Probe"
TOKEN = "alice-token-0123456789"


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


# --- the servicer under test: bytes in, bytes out ---------------------------------------------


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"fail":
        raise RuntimeError("boom (expected by the test)")
    if request == b"abort":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must not be 'abort'")
    if request == b"whoami":
        principal = current_principal()
        return principal.name.encode() if principal else b"-"
    if request == b"request-id":
        return (current_request_id() or "-").encode()
    return request


async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(int(request)):
        yield str(i).encode()


async def collect(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    return b",".join([r async for r in requests])


async def shout(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
    async for request in requests:
        if request == b"fail":
            raise RuntimeError("stream failed (expected by the test)")
        yield request.upper()


async def shout_writer(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
    """The reader/writer handler style (a coroutine calling context.write)."""
    async for request in requests:
        await context.write(request.upper())


def _identity(data: bytes) -> bytes:
    return data


def register(server: grpc.aio.Server) -> None:
    codec = {"request_deserializer": _identity, "response_serializer": _identity}
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, **codec),
        "Count": grpc.unary_stream_rpc_method_handler(count, **codec),
        "Collect": grpc.stream_unary_rpc_method_handler(collect, **codec),
        "Shout": grpc.stream_stream_rpc_method_handler(shout, **codec),
        "ShoutWriter": grpc.stream_stream_rpc_method_handler(shout_writer, **codec),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])


@asynccontextmanager
async def serving(
    registry: CollectorRegistry | None = None,
    authenticator: Authenticator | None = None,
    metrics: MetricsConfig | None = None,
    bearer_token: str | None = None,
) -> AsyncIterator[tuple[GrpcService, grpc.aio.Channel]]:
    service = GrpcService(
        GrpcServerConfig(grace_s=1.0),
        service_name="coretest",
        register=[register],
        service_names=[SERVICE],
        registry=registry or CollectorRegistry(),
        authenticator=authenticator,
        metrics=metrics,
    )
    async with service:
        target = f"127.0.0.1:{service.port}"
        async with make_channel(target, default_timeout_s=20.0, bearer_token=bearer_token) as ch:
            yield service, ch


async def stream_of(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def rpc_code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# --- health and reflection ---------------------------------------------------------------------


def test_health_reports_serving_for_server_and_registered_service() -> None:
    async def scenario() -> None:
        async with serving() as (_, channel):
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
            assert unknown.value.code() is grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_reflection_lists_registered_service() -> None:
    async def scenario() -> None:
        async with serving() as (_, channel):
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in stub.ServerReflectionInfo(stream_of(request))]
            names = {s.name for s in replies[0].list_services_response.service}
            assert SERVICE in names
            assert "grpc.health.v1.Health" in names

    asyncio.run(scenario())


# --- request id --------------------------------------------------------------------------------


def test_request_id_is_generated_and_returned_in_initial_metadata() -> None:
    async def scenario() -> None:
        async with serving() as (_, channel):
            call = channel.unary_unary(method("Echo"))(b"request-id")
            seen_by_handler = (await call).decode()
            sent_back = (await call.initial_metadata()).get("x-request-id")
            assert sent_back == seen_by_handler
            assert len(sent_back) == 32

    asyncio.run(scenario())


def test_given_request_id_is_preserved() -> None:
    async def scenario() -> None:
        async with serving() as (_, channel):
            call = channel.unary_unary(method("Echo"))(
                b"request-id", metadata=(("x-request-id", "job-7.step-3"),)
            )
            assert await call == b"job-7.step-3"
            assert (await call.initial_metadata()).get("x-request-id") == "job-7.step-3"

    asyncio.run(scenario())


@pytest.mark.parametrize("given", ["has spaces; and {braces}", "x" * 129])
def test_malformed_request_id_is_replaced(given: str) -> None:
    """Request ids end up in every log line, so arbitrary caller text is not trusted."""

    async def scenario() -> None:
        async with serving() as (_, channel):
            call = channel.unary_unary(method("Echo"))(
                b"request-id", metadata=(("x-request-id", given),)
            )
            replaced = (await call).decode()
            assert replaced != given
            assert len(replaced) == 32
            assert (await call.initial_metadata()).get("x-request-id") == replaced

    asyncio.run(scenario())


# --- metrics -----------------------------------------------------------------------------------


def test_metrics_count_calls_by_method_and_code_in_registry_and_over_http() -> None:
    registry = CollectorRegistry()

    async def scenario() -> str:
        async with serving(registry, metrics=MetricsConfig(port=0)) as (service, channel):
            echo_call = channel.unary_unary(method("Echo"))
            assert await echo_call(b"a") == b"a"
            assert await echo_call(b"b") == b"b"
            assert await rpc_code(echo_call(b"abort")) is grpc.StatusCode.INVALID_ARGUMENT
            assert await rpc_code(echo_call(b"fail")) is grpc.StatusCode.UNKNOWN
            url = f"http://127.0.0.1:{service.metrics_port}/metrics"
            return await asyncio.to_thread(_http_get, url)

    body = asyncio.run(scenario())

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"relayrl_coretest_{name}", labels)

    echo_method = method("Echo")
    assert sample("grpc_requests_total", method=echo_method, code="OK") == 2
    assert sample("grpc_requests_total", method=echo_method, code="INVALID_ARGUMENT") == 1
    assert sample("grpc_requests_total", method=echo_method, code="UNKNOWN") == 1
    assert sample("grpc_errors_total", method=echo_method, code="UNKNOWN") == 1
    assert sample("grpc_errors_total", method=echo_method, code="OK") is None
    assert sample("grpc_request_duration_seconds_count", method=echo_method) == 4

    ok_line = f'relayrl_coretest_grpc_requests_total{{code="OK",method="{echo_method}"}} 2.0'
    assert ok_line in body.splitlines()
    error_line = (
        f'relayrl_coretest_grpc_errors_total{{code="INVALID_ARGUMENT",method="{echo_method}"}} 1.0'
    )
    assert error_line in body.splitlines()


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def test_unexpected_exception_is_logged_with_traceback_and_abort_as_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        async with serving() as (_, channel):
            echo_call = channel.unary_unary(method("Echo"))
            await rpc_code(echo_call(b"fail"))
            await rpc_code(echo_call(b"abort"))
            await echo_call(b"fine")

    with caplog.at_level(logging.INFO, logger="relayrl.coretest.grpc"):
        asyncio.run(scenario())
    calls = [r for r in caplog.records if r.name == "relayrl.coretest.grpc"]
    by_code = {r.grpc_code: r for r in calls}
    assert by_code["UNKNOWN"].levelno == logging.ERROR
    assert by_code["UNKNOWN"].exc_info is not None
    assert "boom" in str(by_code["UNKNOWN"].exc_info[1])
    assert by_code["INVALID_ARGUMENT"].levelno == logging.WARNING
    assert by_code["OK"].levelno == logging.INFO
    assert all(r.grpc_method == method("Echo") for r in calls)


# --- authentication ----------------------------------------------------------------------------


def test_auth_rejects_call_without_token_and_keeps_health_open() -> None:
    registry = CollectorRegistry()
    authenticator = StaticTokenAuthenticator({"alice": TOKEN})

    async def scenario() -> None:
        async with serving(registry, authenticator) as (_, channel):
            with pytest.raises(grpc.aio.AioRpcError) as rejected:
                await channel.unary_unary(method("Echo"))(b"whoami")
            assert rejected.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <token>" in (rejected.value.details() or "")

            wrong = (("authorization", "Bearer not-the-token-0123456789"),)
            code = await rpc_code(channel.unary_unary(method("Echo"))(b"x", metadata=wrong))
            assert code is grpc.StatusCode.UNAUTHENTICATED

            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())
    assert (
        registry.get_sample_value(
            "relayrl_coretest_grpc_requests_total",
            {"method": method("Echo"), "code": "UNAUTHENTICATED"},
        )
        == 2
    )


def test_auth_passes_with_token_and_exposes_principal_to_handler() -> None:
    authenticator = StaticTokenAuthenticator({"alice": TOKEN, "bob": "bob-token-0123456789"})

    async def scenario() -> None:
        async with serving(authenticator=authenticator, bearer_token=TOKEN) as (_, channel):
            assert await channel.unary_unary(method("Echo"))(b"whoami") == b"alice"
            replies = [r async for r in channel.unary_stream(method("Count"))(b"2")]
            assert replies == [b"0", b"1"]

    asyncio.run(scenario())


# --- the four RPC kinds through every interceptor ------------------------------------------------


def test_all_rpc_kinds_work_through_all_interceptors() -> None:
    registry = CollectorRegistry()
    authenticator = StaticTokenAuthenticator({"alice": TOKEN})

    async def scenario() -> None:
        async with serving(registry, authenticator, bearer_token=TOKEN) as (_, channel):
            count_call = channel.unary_stream(method("Count"))(b"3")
            assert [r async for r in count_call] == [b"0", b"1", b"2"]
            assert (await count_call.initial_metadata()).get("x-request-id")

            collected = await channel.stream_unary(method("Collect"))(stream_of(b"a", b"b"))
            assert collected == b"a,b"

            shout_call = channel.stream_stream(method("Shout"))(stream_of(b"hi", b"there"))
            assert [r async for r in shout_call] == [b"HI", b"THERE"]

            writer_call = channel.stream_stream(method("ShoutWriter"))(stream_of(b"x", b"y"))
            assert [r async for r in writer_call] == [b"X", b"Y"]

            failing = channel.stream_stream(method("Shout"))(stream_of(b"ok", b"fail"))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in failing:
                    pass
            assert failed.value.code() is grpc.StatusCode.UNKNOWN

    asyncio.run(scenario())
    for name, code in [
        ("Count", "OK"),
        ("Collect", "OK"),
        ("Shout", "OK"),
        ("ShoutWriter", "OK"),
        ("Shout", "UNKNOWN"),
    ]:
        labels = {"method": method(name), "code": code}
        assert registry.get_sample_value("relayrl_coretest_grpc_requests_total", labels) == 1


# --- binding -----------------------------------------------------------------------------------


def test_port_in_use_is_a_clear_error() -> None:
    async def scenario() -> None:
        async with serving() as (first, _):
            config = GrpcServerConfig(port=first.port)
            second = GrpcService(
                config,
                service_name="coretest",
                register=[register],
                service_names=[SERVICE],
                registry=CollectorRegistry(),
            )
            with pytest.raises(OSError, match=r"grpc\.port"):
                await second.start()

    asyncio.run(scenario())


# --- a service built from its config -----------------------------------------------------------


def test_build_service_takes_auth_and_metrics_from_the_service_config(tmp_path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"alice: {TOKEN}\n")
    path = tmp_path / "service.yaml"
    path.write_text(f"auth:\n  type: static_token\n  tokens_file: {tokens}\n")
    config = load_config(ServiceConfig, path, "RELAYRL_CORETEST", {})

    async def scenario() -> None:
        registry = CollectorRegistry()
        service = build_service(
            config,
            service_name="coretest",
            register=[register],
            service_names=[SERVICE],
            registry=registry,
        )
        async with service:
            target = f"127.0.0.1:{service.port}"
            async with make_channel(target, default_timeout_s=20.0) as anonymous:
                health = health_pb2_grpc.HealthStub(anonymous)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                code = await rpc_code(anonymous.unary_unary(method("Echo"))(b"whoami"))
                assert code is grpc.StatusCode.UNAUTHENTICATED
            async with make_channel(target, default_timeout_s=20.0, bearer_token=TOKEN) as alice:
                assert await alice.unary_unary(method("Echo"))(b"whoami") == b"alice"
            with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics") as r:
                text = r.read().decode()
            assert 'relayrl_coretest_grpc_requests_total{code="UNAUTHENTICATED"' in text

    asyncio.run(scenario())
