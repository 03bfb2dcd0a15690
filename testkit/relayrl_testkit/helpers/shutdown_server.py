"""A service built with the core bootstrap, run as a real process by test_core_shutdown.py.

    python -m relayrl_testkit.helpers.shutdown_server GRACE_S

Prints `port <n>` once serving, `slow call started` when a Hold call arrives, and
`shutdown hook ran` from its shutdown hook; logs go to stderr. Hold blocks until the file
named in its request exists, so the test, not a timer, decides when an in-flight call ends.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from relayrl.core.config import GrpcServerConfig, LoggingConfig, MetricsConfig
from relayrl.core.grpc_server import GrpcService
from relayrl.core.logs import setup_logging

SERVICE = "relayrl.coretest.v1.Shutdown"


async def hold(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    print("slow call started", flush=True)
    release = Path(request.decode())
    while not release.exists():
        await asyncio.sleep(0.02)
    return b"released"


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def register(server: grpc.aio.Server) -> None:
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=bytes, response_serializer=bytes
        )
        for name, fn in (("Hold", hold), ("Echo", echo))
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])


async def shutdown_hook() -> None:
    print("shutdown hook ran", flush=True)


def announce(service: GrpcService) -> None:
    print(f"port {service.port}", flush=True)


async def main(grace_s: float) -> None:
    setup_logging(LoggingConfig(), "coretest")
    service = GrpcService(
        GrpcServerConfig(grace_s=grace_s),
        service_name="coretest",
        register=[register],
        service_names=[SERVICE],
        registry=CollectorRegistry(),
        metrics=MetricsConfig(port=0),
        shutdown_hooks=[shutdown_hook],
    )
    await service.run_until_signal(on_started=announce)
    print("exiting", flush=True)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
