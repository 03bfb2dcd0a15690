"""Client side of the service bootstrap: channels with explicit options, a deadline on every
call, request-id propagation, and bounded retries for idempotent calls only.

    channel = channel_from_config(config.weightsync_client)
    stub = WeightSyncStub(channel)
    version = await call_idempotent(stub.GetVersion, GetVersionRequest(), timeout_s=5.0)

Retries are opt-in per call site (`call_idempotent`) rather than a channel-wide service config,
because only the caller knows whether repeating a request is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from relayrl.core.config import (
    MIB,
    ClientCredentialsConfig,
    ConfigError,
    GrpcClientConfig,
    GrpcKeepaliveConfig,
    load_client_token,
)
from relayrl.core.interceptors import AUTHORIZATION_KEY, REQUEST_ID_KEY
from relayrl.core.logs import REQUEST_ID

logger = logging.getLogger(__name__)

ResponseT = TypeVar("ResponseT")


def channel_options(
    *,
    max_message_bytes: int = 64 * MIB,
    keepalive: GrpcKeepaliveConfig | None = None,
    keepalive_permit_without_calls: bool = True,
) -> list[tuple[str, int]]:
    """Channel arguments matching the server's (see grpc_server.server_options); `keepalive`
    defaults to GrpcKeepaliveConfig's. The client keepalive interval must stay >= the server's
    min_ping_interval_s or the server sends GOAWAY too_many_pings."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *keepalive_options(keepalive or GrpcKeepaliveConfig(), keepalive_permit_without_calls),
    ]


def keepalive_options(
    keepalive: GrpcKeepaliveConfig, permit_without_calls: bool
) -> list[tuple[str, int]]:
    """The channel arguments that make `keepalive` hold, on a client or a server. gRPC's own
    defaults do not: a ping is timed out by the HTTP/2 ping timeout (60 s), not by
    keepalive_timeout_ms alone, and no more than two pings go out while no data does, so a
    call waiting for a peer that went silent would stop pinging it (both measured with
    grpcio 1.85; tests/integration/core/test_core_grpc_keepalive.py)."""
    timeout_ms = milliseconds(keepalive.timeout_s)
    return [
        ("grpc.keepalive_time_ms", milliseconds(keepalive.time_s)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", int(permit_without_calls)),
    ]


def milliseconds(seconds: float) -> int:
    """A duration as gRPC's channel arguments take it."""
    return round(seconds * 1000)


class CallDefaults:
    """Fills in what a call left out: a deadline (no call may wait forever on a stuck peer),
    the request id of the call being served (so one id spans services), and optionally a
    bearer token. Values the caller set explicitly win."""

    def __init__(self, default_timeout_s: float, bearer_token: str | None = None) -> None:
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        self._default_timeout_s = default_timeout_s
        self._bearer_token = bearer_token

    def complete(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        request_id = REQUEST_ID.get()
        if request_id is not None and REQUEST_ID_KEY not in metadata:
            metadata.add(REQUEST_ID_KEY, request_id)
        if self._bearer_token is not None and AUTHORIZATION_KEY not in metadata:
            metadata.add(AUTHORIZATION_KEY, f"Bearer {self._bearer_token}")
        timeout = self._default_timeout_s if details.timeout is None else details.timeout
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """One interceptor per RPC kind: grpc.aio files an interceptor object under the first
        kind it implements only, so a single class implementing all four would silently skip
        streaming calls."""
        return [
            _UnaryUnaryDefaults(self),
            _UnaryStreamDefaults(self),
            _StreamUnaryDefaults(self),
            _StreamStreamDefaults(self),
        ]


class _UnaryUnaryDefaults(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, defaults: CallDefaults) -> None:
        self._defaults = defaults

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._defaults.complete(client_call_details), request)


class _UnaryStreamDefaults(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, defaults: CallDefaults) -> None:
        self._defaults = defaults

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._defaults.complete(client_call_details), request)


class _StreamUnaryDefaults(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, defaults: CallDefaults) -> None:
        self._defaults = defaults

    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._defaults.complete(client_call_details), request_iterator)


class _StreamStreamDefaults(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, defaults: CallDefaults) -> None:
        self._defaults = defaults

    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._defaults.complete(client_call_details), request_iterator)


def make_channel(
    target: str,
    *,
    max_message_bytes: int = 64 * MIB,
    keepalive: GrpcKeepaliveConfig | None = None,
    default_timeout_s: float = 30.0,
    bearer_token: str | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel with explicit options and the CallDefaults interceptors first, so
    later interceptors already see the deadline; plaintext unless `credentials` are given
    (see `tls_credentials`). Each of `interceptors` is applied to the first RPC kind it
    implements only (grpc.aio)."""
    if not target:
        raise ValueError("target must be a gRPC target such as 'dns:///reward:50051'")
    options = channel_options(max_message_bytes=max_message_bytes, keepalive=keepalive)
    chain = [*CallDefaults(default_timeout_s, bearer_token).interceptors(), *interceptors]
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options, interceptors=chain)
    return grpc.aio.insecure_channel(target, options=options, interceptors=chain)


def tls_credentials(
    ca_file: Path, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials:
    """Client TLS: trust `ca_file`; with a certificate and key, present them (mutual TLS)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("give both cert_file and key_file for a client certificate, or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=ca_file.read_bytes(),
        private_key=key_file.read_bytes() if key_file else None,
        certificate_chain=cert_file.read_bytes() if cert_file else None,
    )


@dataclass(frozen=True)
class ClientIdentity:
    """What a client section resolves to: TLS credentials and options, and a bearer token."""

    credentials: grpc.ChannelCredentials | None = None
    options: tuple[tuple[str, str], ...] = ()
    token: str | None = None

    @classmethod
    def from_config(
        cls,
        config: ClientCredentialsConfig | None,
        label: str,
        environ: Mapping[str, str] = os.environ,
    ) -> ClientIdentity:
        """Reads the files `config` names now (a mistake is a ConfigError naming `label`, the
        section, before any call is made)."""
        if config is None:
            return cls()
        token = load_client_token(config, label, environ)
        tls = config.tls
        if tls is None:
            return cls(token=token)

        def read(path: Path, field: str) -> bytes:
            try:
                return path.read_bytes()
            except OSError as exc:
                raise ConfigError(
                    f"{path} ({label}.tls.{field}): cannot read: {exc.strerror}"
                ) from None

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(tls.ca_file, "ca_file"),
            private_key=read(tls.key_file, "key_file") if tls.key_file else None,
            certificate_chain=read(tls.cert_file, "cert_file") if tls.cert_file else None,
        )
        options = (("grpc.ssl_target_name_override", tls.server_name),) if tls.server_name else ()
        return cls(credentials=credentials, options=options, token=token)


def channel_from_config(
    config: GrpcClientConfig, *, label: str = "client", environ: Mapping[str, str] = os.environ
) -> grpc.aio.Channel:
    """An asyncio channel as `config` says, with its TLS and token (`label`: the section's name,
    for errors)."""
    identity = ClientIdentity.from_config(config, label, environ)
    options = channel_options(
        max_message_bytes=config.max_message_bytes, keepalive=config.keepalive
    )
    chain = CallDefaults(config.default_timeout_s, identity.token).interceptors()
    if identity.credentials is not None:
        return grpc.aio.secure_channel(
            config.target, identity.credentials, [*options, *identity.options], interceptors=chain
        )
    return grpc.aio.insecure_channel(config.target, options=options, interceptors=chain)


def sync_channel(
    target: str, identity: ClientIdentity, options: Sequence[tuple[str, Any]]
) -> grpc.Channel:
    """A blocking channel to `target` with `identity`'s TLS and token (the clients that run in
    threads: the trainer's links, an engine worker's pull)."""
    if identity.credentials is not None:
        channel = grpc.secure_channel(
            target, identity.credentials, options=[*options, *identity.options]
        )
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    if identity.token is None:
        return channel
    return grpc.intercept_channel(channel, _BearerToken(identity.token))


class _SyncCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = getattr(details, "compression", None)


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._entry = (AUTHORIZATION_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTHORIZATION_KEY]
        return _SyncCallDetails(details, [*metadata, self._entry])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter. Only UNAVAILABLE is retried by default: the
    request never reached a handler (or the peer is restarting). DEADLINE_EXCEEDED is not,
    since the work may still be running and the caller's time budget is spent anyway."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    jitter: bool = True
    retryable_codes: frozenset[grpc.StatusCode] = field(
        default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE})
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                "need 0 < initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")

    def backoff_s(self, retry_index: int, rng: random.Random | None = None) -> float:
        """Sleep before retry number `retry_index` (0-based); jitter spreads retries of many
        clients that failed together over [backoff/2, backoff]."""
        backoff = min(
            self.max_backoff_s, self.initial_backoff_s * self.backoff_multiplier**retry_index
        )
        if not self.jitter:
            return backoff
        return backoff * (rng or random).uniform(0.5, 1.0)


async def call_idempotent(
    fn: Callable[..., Awaitable[ResponseT]],
    request: Any,
    *,
    timeout_s: float,
    policy: RetryPolicy | None = None,
    metadata: Sequence[tuple[str, str | bytes]] | None = None,
) -> ResponseT:
    """Call a unary-unary method (`stub.Method`) and retry per `policy`.

    Only for idempotent methods: a retried call may have run on the server already.
    `timeout_s` bounds the whole call, retries and backoff included, so a caller's deadline
    means the same with or without retries; each attempt gets what is left."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    policy = policy or RetryPolicy()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return await fn(request, timeout=deadline - loop.time(), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            delay_s = policy.backoff_s(attempt - 1)
            if (
                exc.code() not in policy.retryable_codes
                or attempt == policy.max_attempts
                or loop.time() + delay_s >= deadline
            ):
                raise
            logger.info(
                "attempt %d/%d failed with %s (%s); retrying in %.2f s",
                attempt,
                policy.max_attempts,
                exc.code().name,
                exc.details(),
                delay_s,
            )
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable: the last attempt returns or raises")
