"""The gRPC server every service runs: explicit options, the standard interceptors, health,
reflection, a /metrics endpoint and a graceful SIGTERM shutdown.

A service main looks like this (config parsed before heavy imports, registry owned by main):

    async def serve(config: RewardConfig) -> None:
        registry = CollectorRegistry()
        reward = RewardService(config, registry)            # the logic, no gRPC in it
        service = build_service(
            config,
            service_name="reward",
            register=[lambda server: add_RewardServiceServicer_to_server(
                RewardServicer(reward), server)],
            service_names=[REWARD_SERVICE_FULL_NAME],
            registry=registry,
            shutdown_hooks=[reward.close],
        )
        await service.run_until_signal(on_started=lambda s: logger.info("port %d", s.port))

On SIGTERM/SIGINT: health goes NOT_SERVING (load balancers stop routing), the server stops
accepting calls and gives in-flight ones `grace_s` to finish, then the shutdown hooks close the
components (newest first), then the metrics endpoint stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from relayrl.core.atomic import atomic_write_text
from relayrl.core.config import (
    DEFAULT_EXEMPT_METHODS,
    ConfigError,
    GrpcServerConfig,
    MetricsConfig,
    ServiceConfig,
    StaticTokenAuthConfig,
    TlsServerConfig,
)
from relayrl.core.grpc_client import keepalive_options, milliseconds
from relayrl.core.interceptors import (
    AccessPolicy,
    AnyOfAuthenticator,
    Authenticator,
    build_authenticator,
    roles_function,
    server_interceptors,
)
from relayrl.core.metrics import MetricsServer, check_service_name

logger = logging.getLogger(__name__)

Register = Callable[[grpc.aio.Server], None]
ShutdownHook = Callable[[], Awaitable[None]]
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def server_options(config: GrpcServerConfig) -> list[tuple[str, int]]:
    """Channel arguments spelled out, so message limits and keepalive never silently fall back
    to gRPC's defaults (4 MiB messages, no keepalive)."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        *keepalive_options(config.keepalive, config.keepalive_permit_without_calls),
        ("grpc.http2.min_ping_interval_without_data_ms", milliseconds(config.min_ping_interval_s)),
        # Without this a second server could bind the same port and steal half the calls.
        ("grpc.so_reuseport", 0),
    ]


def host_port(host: str, port: int) -> str:
    """`host:port`, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcService:
    """One service's gRPC server and its lifecycle. Built directly or by `build_service`;
    the grpc.aio server itself is created in `start()`, inside the event loop that serves it."""

    def __init__(
        self,
        config: GrpcServerConfig,
        *,
        service_name: str,
        register: Sequence[Register],
        service_names: Sequence[str],
        registry: CollectorRegistry,
        authenticator: Authenticator | None = None,
        exempt_methods: Iterable[str] = DEFAULT_EXEMPT_METHODS,
        access: Sequence[AccessPolicy] = (),
        roles_of: Callable[[str], frozenset[str]] | None = None,
        metrics: MetricsConfig | None = None,
        shutdown_hooks: Iterable[ShutdownHook] = (),
    ) -> None:
        check_service_name(service_name)
        for name in service_names:
            if not name or name.startswith("/") or "/" in name:
                raise ValueError(
                    f"service name {name!r} must be a full proto service name such as "
                    "'relayrl.reward.v1.RewardService' (no slashes)"
                )
        self.config = config
        self.service_name = service_name
        self._register = list(register)
        self._service_names = list(service_names)
        self._interceptors = server_interceptors(
            service_name, registry, authenticator, exempt_methods, access=access, roles_of=roles_of
        )
        self._metrics_server = (
            MetricsServer.from_config(metrics, registry) if metrics and metrics.enabled else None
        )
        self._shutdown_hooks = list(shutdown_hooks)
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._port: int | None = None
        self._stop_task: asyncio.Task[None] | None = None

    # --- state ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound gRPC port (the chosen one when the config says 0)."""
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port, or None when metrics are disabled."""
        return self._metrics_server.port if self._metrics_server else None

    @property
    def health(self) -> health_aio.HealthServicer:
        """The health servicer, for components that want to report NOT_SERVING themselves."""
        if self._health is None:
            raise RuntimeError("the server is not started")
        return self._health

    def add_shutdown_hook(self, hook: ShutdownHook) -> None:
        """Run `hook` after the server has stopped; hooks run newest first, like a stack."""
        self._shutdown_hooks.append(hook)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> int:
        """Create, bind and start the server, mark every service SERVING; return the port."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        server = grpc.aio.server(
            interceptors=self._interceptors,
            options=server_options(self.config),
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs,
        )
        self._health = health_aio.HealthServicer()
        await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for register in self._register:
            register(server)
        reflection.enable_server_reflection(
            [*self._service_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        self._port = self._bind(server)
        self._server = server
        await server.start()
        try:
            if self._metrics_server is not None:
                self._metrics_server.start()
        except BaseException:
            await server.stop(None)
            raise
        for name in ("", *self._service_names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving gRPC on %s", self.service_name, self.address)
        return self._port

    def _bind(self, server: grpc.aio.Server) -> int:
        address = host_port(self.config.host, self.config.port)
        tls = self.config.tls
        try:
            if tls is not None:
                return server.add_secure_port(address, server_credentials(tls))
            return server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(
                f"cannot bind the gRPC server to {address} (in use, or not a local "
                "address); choose another grpc.port (0 picks a free one) or grpc.host"
            ) from exc

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop (idempotent; concurrent callers wait for the same stop)."""
        if self._server is None:
            return
        if self._stop_task is None:
            grace = self.config.grace_s if grace_s is None else grace_s
            self._stop_task = asyncio.ensure_future(self._stop(self._server, grace))
        await asyncio.shield(self._stop_task)

    async def _stop(self, server: grpc.aio.Server, grace_s: float) -> None:
        logger.info(
            "%s stopping: health NOT_SERVING, in-flight calls get %.1f s",
            self.service_name,
            grace_s,
        )
        await self.health.enter_graceful_shutdown()
        await server.stop(grace_s)
        logger.info(
            "%s gRPC server stopped; running %d shutdown hooks",
            self.service_name,
            len(self._shutdown_hooks),
        )
        try:
            await self._run_shutdown_hooks()
        finally:
            if self._metrics_server is not None:
                await asyncio.to_thread(self._metrics_server.stop)

    async def _run_shutdown_hooks(self) -> None:
        """Run every hook even if one fails (each failure logged), then report them all."""
        errors: list[Exception] = []
        for hook in reversed(self._shutdown_hooks):
            try:
                await hook()
            except Exception as exc:
                logger.exception("shutdown hook %r failed", hook)
                errors.append(exc)
        if errors:
            raise ExceptionGroup(f"{len(errors)} shutdown hooks failed", errors)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def run_until_signal(
        self,
        signals: Iterable[signal.Signals] = STOP_SIGNALS,
        on_started: Callable[[GrpcService], object] | None = None,
    ) -> None:
        """Start (if needed), serve until one of `signals`, then stop gracefully and return.

        Handlers are installed before starting, so a SIGTERM that arrives during start-up
        still ends in a graceful stop rather than the default kill."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        installed = list(signals)

        def on_signal(signum: signal.Signals) -> None:
            if stop_requested.is_set():
                logger.warning("%s received during shutdown; still waiting", signum.name)
                return
            logger.info("%s received %s; shutting down", self.service_name, signum.name)
            stop_requested.set()

        for signum in installed:
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            if self._server is None:
                await self.start()
            if on_started is not None:
                on_started(self)
            await stop_requested.wait()
            await self.stop()
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)

    async def __aenter__(self) -> GrpcService:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def server_credentials(tls: TlsServerConfig) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; an unreadable file is an OSError naming it."""

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise OSError(f"grpc.tls.{what}: cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_server_credentials(
        [(read(tls.key_file, "key_file"), read(tls.cert_file, "cert_file"))],
        root_certificates=read(tls.client_ca_file, "client_ca_file")
        if tls.client_ca_file
        else None,
        require_client_auth=tls.require_client_cert,
    )


def write_ready_file(
    path: Path, service: GrpcService, extra: Mapping[str, object] | None = None
) -> None:
    """Write `{"pid", "grpc_port", "metrics_port"}` (plus `extra`, e.g. a service's other
    ports) to `path` atomically (a reader never sees a half-written file): the handshake
    between a started service and whoever started it."""
    data = {
        **(extra or {}),
        "pid": os.getpid(),
        "grpc_port": service.port,
        "metrics_port": service.metrics_port,
    }
    atomic_write_text(path, json.dumps(data))


def build_service(
    config: ServiceConfig,
    *,
    service_name: str,
    register: Sequence[Register],
    service_names: Sequence[str],
    registry: CollectorRegistry,
    access: Sequence[AccessPolicy] = (),
    minted: Authenticator | None = None,
    shutdown_hooks: Iterable[ShutdownHook] = (),
    environ: Mapping[str, str] = os.environ,
) -> GrpcService:
    """A not-yet-started GrpcService from a ServiceConfig: its grpc, metrics and auth sections.
    `register` callables add servicers to the grpc.aio server (e.g.
    `lambda s: add_FooServicer_to_server(servicer, s)`); `service_names` are their full proto
    names, for health and reflection. With authentication, `access` (the service's table)
    says which roles may call each method, and `minted` also accepts the short-lived
    credentials the service hands out itself (after the configured ones)."""
    auth = config.auth
    exempt = auth.exempt_methods if isinstance(auth, StaticTokenAuthConfig) else ()
    authenticator = build_authenticator(auth, environ)
    if authenticator is None:
        logger.warning(
            "%s: auth.type none: every caller that reaches the port may call every method; "
            "set auth (static_token or mtls) on a shared network",
            service_name,
        )
    elif minted is not None:
        authenticator = AnyOfAuthenticator(authenticator, minted)
    return GrpcService(
        config.grpc,
        service_name=service_name,
        register=register,
        service_names=service_names,
        registry=registry,
        authenticator=authenticator,
        exempt_methods=exempt,
        access=access,
        roles_of=roles_function(auth),
        metrics=config.metrics,
        shutdown_hooks=shutdown_hooks,
    )


def serve_process(
    config: ServiceConfig,
    service_name: str,
    main: Callable[[], Awaitable[None]],
    user_errors: tuple[type[Exception], ...] = (OSError,),
) -> int:
    """The body of a service's `serve(config, ready_file) -> exit code`: logging, the event
    loop, and a deployment mistake (a taken port, a missing file: `user_errors`) as one log
    line and exit code 1 instead of a traceback."""
    from relayrl.core.logs import setup_logging

    setup_logging(config.logging, service_name)
    try:
        build_authenticator(config.auth)  # a bad secrets file: said before anything connects
        asyncio.run(main())
    except (ConfigError, *user_errors) as exc:
        logger.error("%s", exc)
        return 1
    return 0
