"""Server interceptors shared by every service: request id, logging, metrics, authentication.

Each interceptor contributes a *call scope*: an async context manager entered around the
handler of every call. `wrap_handler` is the one place that knows the four RPC kinds and the
two handler styles (coroutine, async generator), so each interceptor is a few lines about its
own concern and works for unary and streaming calls alike.

Order matters and is fixed by `server_interceptors`: request id first (so every log line of the
call carries it), then logging and metrics (so rejected calls are logged and counted), then
authentication, closest to the handler.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import hmac
import inspect
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from relayrl.core.config import (
    DEFAULT_EXEMPT_METHODS,
    HEALTH_METHODS,
    TOKEN_DIGEST_PREFIX,
    MtlsAuthConfig,
    NoAuthConfig,
    StaticTokenAuthConfig,
    load_static_tokens,
)
from relayrl.core.logs import REQUEST_ID
from relayrl.core.metrics import metric_name

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
DURATION_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip

Metadata = Sequence[tuple[str, str | bytes]]
AuthContext = Mapping[str, Sequence[bytes]]
CallScope = Callable[
    [grpc.HandlerCallDetails, grpc.aio.ServicerContext], AbstractAsyncContextManager[None]
]


@dataclass(frozen=True)
class Principal:
    """Who is calling, as established by an Authenticator."""

    name: str


PRINCIPAL: ContextVar[Principal | None] = ContextVar("relayrl_principal", default=None)


def current_principal() -> Principal | None:
    """The authenticated caller of the call being served (None without auth)."""
    return PRINCIPAL.get()


# --- the generic handler wrapper -------------------------------------------------------------

_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class _Undecodable:
    """Stands in for a request message that failed to parse, so the handler's scope can refuse
    it with INVALID_ARGUMENT (gRPC itself would answer UNKNOWN with a Python exception name)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(exc)

    return decode


async def _refuse_undecodable(
    request: Any, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext
) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{details.method}: the request is not a valid message ({request.error}); check "
            "that the client was generated from the same .proto",
        )


def wrap_handler(
    handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails, scope: CallScope
) -> grpc.RpcMethodHandler:
    """Return `handler` with `scope(details, context)` entered around every invocation, and
    requests that do not parse refused with INVALID_ARGUMENT inside that scope.

    Handlers must be `async def` (returning a response, or writing with context.write) or
    async generators; a sync handler is refused rather than passed through unwrapped, because
    skipping the scope would skip authentication."""
    attr, factory = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, attr)
    streaming_request = handler.request_streaming
    # Only the innermost wrapper (the scope closest to the handler: authentication, when
    # there is one) refuses requests that do not parse, so a caller that is not allowed to
    # call learns nothing about its request, only that it may not call.
    inner = getattr(behavior, "_relayrl_wrapped", False)

    async def refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
        if not inner:
            await _refuse_undecodable(request, details, context)

    def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if inner or not streaming_request:
            return request

        async def messages() -> AsyncIterator[Any]:
            async for message in request:
                await _refuse_undecodable(message, details, context)
                yield message

        return messages()

    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behavior):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with scope(details, context):
                await refuse_undecodable(request, context)
                async for response in behavior(checked(request, context), context):
                    yield response

    elif inspect.iscoroutinefunction(behavior):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with scope(details, context):
                await refuse_undecodable(request, context)
                return await behavior(checked(request, context), context)

    else:
        raise TypeError(
            f"{details.method}: handler {behavior!r} is synchronous; relayrl servers need "
            "`async def` handlers or async generators"
        )
    wrapped._relayrl_wrapped = True  # type: ignore[attr-defined]
    return factory(
        wrapped,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


def rpc_status(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status the caller sees for a call that ended with `exc` (None: returned normally)."""
    if exc is None or isinstance(exc, grpc.aio.AbortError):
        code = context.code()  # set by context.abort() or context.set_code()
        if code is not None:
            return code
        return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # gRPC cancels the handler both when the caller gives up and when its deadline passes.
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc.aio reports for an unexpected exception


class ScopeInterceptor(grpc.aio.ServerInterceptor):
    """Base: wraps every known method's handler in `self.scope`. Unknown methods (no handler)
    are left to gRPC, which answers UNIMPLEMENTED; that keeps metric labels bounded."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return wrap_handler(handler, handler_call_details, self.scope)

    @abc.abstractmethod
    def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext
    ) -> AbstractAsyncContextManager[None]:
        """Entered around the handler of every call."""


class CallEndInterceptor(ScopeInterceptor):
    """Base of interceptors that act when a call ends, knowing its status and duration."""

    @asynccontextmanager
    async def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        start_s = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            code = rpc_status(context, exc)
            self.call_ended(details.method, code, time.perf_counter() - start_s, exc)
            raise
        code = rpc_status(context, None)
        self.call_ended(details.method, code, time.perf_counter() - start_s, None)

    @abc.abstractmethod
    def call_ended(
        self, method: str, code: grpc.StatusCode, duration_s: float, exc: BaseException | None
    ) -> None:
        """`exc`: what the handler raised (None when it returned)."""


# --- request id ------------------------------------------------------------------------------


def new_request_id() -> str:
    return uuid.uuid4().hex


def metadata_value(metadata: Metadata | None, key: str) -> str | None:
    """The first text value of `key` in gRPC metadata (keys arrive lower-cased)."""
    for item_key, value in metadata or ():
        if item_key == key and isinstance(value, str):
            return value
    return None


class RequestIdInterceptor(ScopeInterceptor):
    """Keeps the caller's `x-request-id` (or makes one), exposes it to logging through the
    REQUEST_ID contextvar and returns it in the initial metadata, so one id follows a request
    across services and appears in the caller's error reports.

    The request id is sent as initial metadata before the handler runs, so handlers must not
    send initial metadata themselves."""

    @asynccontextmanager
    async def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        given = metadata_value(details.invocation_metadata, REQUEST_ID_KEY)
        request_id = given if given and _VALID_REQUEST_ID.match(given) else new_request_id()
        # Not reset afterwards: grpc.aio serves every call in its own task, hence its own copy
        # of the context, and a reset from a finalised async generator would run elsewhere.
        REQUEST_ID.set(request_id)
        await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
        yield


# --- logging ---------------------------------------------------------------------------------


class LoggingInterceptor(CallEndInterceptor):
    """One line per call: method, status code, duration and principal (the request id comes
    from the log filter). Non-OK calls are WARNING; an unexpected exception is ERROR with its
    traceback, since gRPC itself only tells the caller "Unexpected <type>"."""

    def __init__(
        self,
        log: logging.Logger | None = None,
        ok_level: int = logging.INFO,
        quiet_methods: Iterable[str] = HEALTH_METHODS,
    ) -> None:
        self._log = log or logger
        self._ok_level = ok_level
        self._quiet_methods = frozenset(quiet_methods)  # probes every few seconds: DEBUG

    def call_ended(
        self, method: str, code: grpc.StatusCode, duration_s: float, exc: BaseException | None
    ) -> None:
        duration_ms = duration_s * 1000.0
        principal = PRINCIPAL.get()
        fields = {
            "grpc_method": method,
            "grpc_code": code.name,
            "duration_ms": round(duration_ms, 3),
            "principal": principal.name if principal else None,
        }
        message = "rpc %s code=%s duration_ms=%.1f principal=%s"
        args = (method, code.name, duration_ms, fields["principal"] or "-")
        if code is grpc.StatusCode.OK:
            level = logging.DEBUG if method in self._quiet_methods else self._ok_level
            self._log.log(level, message, *args, extra=fields)
        elif code is grpc.StatusCode.UNKNOWN and exc is not None:
            self._log.error(message + " (unexpected exception)", *args, exc_info=exc, extra=fields)
        else:
            self._log.warning(message, *args, extra=fields)


# --- metrics ---------------------------------------------------------------------------------


class MetricsInterceptor(CallEndInterceptor):
    """Request count, latency and errors per method into the service's own registry:
    `relayrl_<service>_grpc_requests_total{method,code}`,
    `relayrl_<service>_grpc_request_duration_seconds{method}`,
    `relayrl_<service>_grpc_errors_total{method,code}` (non-OK only)."""

    def __init__(self, registry: CollectorRegistry, service_name: str) -> None:
        self._requests = Counter(
            metric_name(service_name, "grpc_requests", "total"),
            "gRPC calls handled, by full method name and status code.",
            ["method", "code"],
            registry=registry,
        )
        self._duration = Histogram(
            metric_name(service_name, "grpc_request_duration", "seconds"),
            "Time from the handler's start to its end (streams: the whole stream).",
            ["method"],
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self._errors = Counter(
            metric_name(service_name, "grpc_errors", "total"),
            "gRPC calls that ended with a non-OK status, by method and code.",
            ["method", "code"],
            registry=registry,
        )

    def call_ended(
        self, method: str, code: grpc.StatusCode, duration_s: float, exc: BaseException | None
    ) -> None:
        self._duration.labels(method=method).observe(duration_s)
        self._requests.labels(method=method, code=code.name).inc()
        if code is not grpc.StatusCode.OK:
            self._errors.labels(method=method, code=code.name).inc()


# --- authentication --------------------------------------------------------------------------


class Authenticator(Protocol):
    """Decides who is calling from the call's metadata."""

    @property
    def credentials_hint(self) -> str:
        """What a rejected caller should send, e.g. "metadata 'authorization: Bearer <token>'"."""
        ...

    def authenticate(
        self, method: str, metadata: Metadata, peer: AuthContext | None = None
    ) -> Principal | None:
        """The caller's principal, or None to reject the call with UNAUTHENTICATED. `peer` is
        the transport's auth context (TLS certificate fields), when there is one."""
        ...


def bearer_token(metadata: Metadata | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry (scheme case-insensitive)."""
    value = metadata_value(metadata, AUTHORIZATION_KEY)
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def token_digest(token: str) -> str:
    """`sha256:<hex>` of `token`: what a tokens file may hold instead of the token itself."""
    return TOKEN_DIGEST_PREFIX + hashlib.sha256(token.encode()).hexdigest()


class StaticTokenAuthenticator:
    """Fixed principal → token table (from a mounted Secret); enough for service-to-service
    calls and for a few teams calling the reward-service. Each entry is the token or its
    `sha256:` digest; tokens are compared as digests, so both forms behave alike."""

    credentials_hint = f"metadata '{AUTHORIZATION_KEY}: Bearer <token>'"

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if not tokens:
            raise ValueError("StaticTokenAuthenticator needs at least one principal -> token")
        self._digests = {
            principal: (
                token if token.startswith(TOKEN_DIGEST_PREFIX) else token_digest(token)
            ).encode()
            for principal, token in tokens.items()
        }

    def authenticate(
        self, method: str, metadata: Metadata, peer: AuthContext | None = None
    ) -> Principal | None:
        token = bearer_token(metadata)
        if token is None:
            return None
        given = token_digest(token).encode()
        match = None
        # Compare against every entry so the time taken does not reveal which one is closest.
        for principal, expected in self._digests.items():
            if hmac.compare_digest(given, expected):
                match = principal
        return Principal(match) if match is not None else None


class MintedTokens:
    """Short-lived bearer tokens a service hands out itself (weight-sync, to the engine workers
    of one transfer): each names a principal until it is revoked or its time is up."""

    credentials_hint = f"metadata '{AUTHORIZATION_KEY}: Bearer <token>' minted for this call"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._live: dict[str, tuple[str, float]] = {}  # digest -> principal, expiry

    def mint(self, principal: str, ttl_s: float) -> str:
        now = self._clock()
        self._live = {d: (p, t) for d, (p, t) in self._live.items() if t > now}
        token = secrets.token_urlsafe(32)
        self._live[token_digest(token)] = (principal, now + ttl_s)
        return token

    def revoke(self, token: str) -> None:
        self._live.pop(token_digest(token), None)

    def live_count(self) -> int:
        """Tokens not yet revoked or expired (not `__len__`: an empty store must not be
        falsy, or `store or MintedTokens()` quietly makes a second one)."""
        now = self._clock()
        return sum(1 for _, expiry in self._live.values() if expiry > now)

    def authenticate(
        self, method: str, metadata: Metadata, peer: AuthContext | None = None
    ) -> Principal | None:
        token = bearer_token(metadata)
        entry = self._live.get(token_digest(token)) if token is not None else None
        if entry is None or entry[1] <= self._clock():
            return None
        return Principal(entry[0])


class AnyOfAuthenticator:
    """The first of `authenticators` that accepts the call names the caller (e.g. the static
    tokens of a deployment, then the short-lived tokens a service minted itself)."""

    def __init__(self, *authenticators: Authenticator) -> None:
        self._authenticators = authenticators
        self.credentials_hint = authenticators[0].credentials_hint

    def authenticate(
        self, method: str, metadata: Metadata, peer: AuthContext | None = None
    ) -> Principal | None:
        for authenticator in self._authenticators:
            if (principal := authenticator.authenticate(method, metadata, peer)) is not None:
                return principal
        return None


# --- authorisation ---------------------------------------------------------------------------

ANY_PRINCIPAL = "*"
"""In an access table: every authenticated principal (e.g. the reward API's tenants)."""


@dataclass(frozen=True)
class AccessPolicy:
    """Which roles may call each method of one gRPC service. A method missing from the table
    is refused to everyone (a new RPC is closed until someone decides who may call it)."""

    service: str
    """Full proto service name, e.g. `relayrl.proto.trainer.v1.Trainer`."""
    methods: Mapping[str, frozenset[str]]
    """Method name -> roles allowed (`ANY_PRINCIPAL`: every authenticated caller)."""

    def allowed(self, method: str) -> frozenset[str] | None:
        """The roles allowed to call `method` (`/pkg.Service/Method`); None when this table
        is not about that service."""
        service, _, name = method.strip("/").partition("/")
        if service != self.service:
            return None
        return self.methods.get(name, frozenset())


def access_table(service: str, **methods: tuple[str, ...]) -> AccessPolicy:
    """`access_table("pkg.Svc", Publish=("trainer",), ...)`: an AccessPolicy, written short."""
    return AccessPolicy(service, {name: frozenset(roles) for name, roles in methods.items()})


class CertificateAuthenticator:
    """Mutual TLS: the handshake already proved the client holds a certificate signed by the
    configured CA; its common name is the principal."""

    credentials_hint = "a client certificate signed by the service's client CA"

    def __init__(self, principals: Iterable[str] | None = None) -> None:
        self._principals = None if principals is None else frozenset(principals)

    def authenticate(
        self, method: str, metadata: Metadata, peer: AuthContext | None = None
    ) -> Principal | None:
        names = (peer or {}).get("x509_common_name") or []
        name = names[0].decode(errors="replace") if names else ""
        if not name or (self._principals is not None and name not in self._principals):
            return None
        return Principal(name)


def roles_function(
    config: NoAuthConfig | StaticTokenAuthConfig | MtlsAuthConfig,
) -> Callable[[str], frozenset[str]]:
    """principal -> the roles it acts in, as an `auth:` section says (`auth.roles`, else the
    principal's own name)."""
    if isinstance(config, StaticTokenAuthConfig | MtlsAuthConfig):
        return config.roles_of
    return lambda principal: frozenset([principal])


def build_authenticator(
    config: NoAuthConfig | StaticTokenAuthConfig | MtlsAuthConfig,
    environ: Mapping[str, str] = os.environ,
) -> Authenticator | None:
    """The authenticator an `auth:` section asks for (None: every caller is accepted)."""
    if isinstance(config, NoAuthConfig):
        return None
    if isinstance(config, StaticTokenAuthConfig):
        if config.tokens is not None:
            logger.warning(
                "auth.tokens puts secrets into the config file; prefer auth.tokens_file "
                "(a mounted Secret) or auth.tokens_env"
            )
        return StaticTokenAuthenticator(load_static_tokens(config, environ))
    if isinstance(config, MtlsAuthConfig):
        return CertificateAuthenticator(config.principals)
    assert_never(config)


class AuthInterceptor(ScopeInterceptor):
    """Rejects calls the authenticator does not accept with UNAUTHENTICATED, saying what to
    send, and calls whose principal has none of the roles the access tables allow for the
    method with PERMISSION_DENIED; exempt methods (health, reflection by default) stay open so
    probes work. The principal is available to handlers through `current_principal()`."""

    def __init__(
        self,
        authenticator: Authenticator,
        exempt_methods: Iterable[str] = DEFAULT_EXEMPT_METHODS,
        *,
        access: Sequence[AccessPolicy] = (),
        roles_of: Callable[[str], frozenset[str]] | None = None,
    ) -> None:
        """`roles_of(principal)`: the roles it acts in (default: its own name)."""
        self._authenticator = authenticator
        self._exempt = frozenset(exempt_methods)
        self._access = tuple(access)
        self._roles_of = roles_of or (lambda principal: frozenset([principal]))

    def refusal(self, method: str, principal: str) -> str | None:
        """Why `principal` may not call `method` (None: it may)."""
        for policy in self._access:
            allowed = policy.allowed(method)
            if allowed is None:
                continue
            roles = self._roles_of(principal)
            if ANY_PRINCIPAL in allowed or roles & allowed:
                return None
            if not allowed:
                return f"{method} is not served to any caller"
            return (
                f"{method} is for {', '.join(sorted(allowed))}; {principal!r} acts as "
                f"{', '.join(sorted(roles))}"
            )
        return None  # a service without a table: authentication is all it asks

    def is_exempt(self, method: str) -> bool:
        service, _, _ = method.rpartition("/")
        return method in self._exempt or f"{service}/*" in self._exempt

    @asynccontextmanager
    async def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        if not self.is_exempt(details.method):
            metadata = details.invocation_metadata or ()
            principal = self._authenticator.authenticate(
                details.method, metadata, context.auth_context()
            )
            if principal is None:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{details.method} needs credentials: send "
                    f"{self._authenticator.credentials_hint}",
                )
            if (refusal := self.refusal(details.method, principal.name)) is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            PRINCIPAL.set(principal)  # per-call task context, see RequestIdInterceptor
        yield


def server_interceptors(
    service_name: str,
    registry: CollectorRegistry,
    authenticator: Authenticator | None = None,
    exempt_methods: Iterable[str] = DEFAULT_EXEMPT_METHODS,
    *,
    access: Sequence[AccessPolicy] = (),
    roles_of: Callable[[str], frozenset[str]] | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """The standard chain, outermost first: request id, logging, metrics, auth (with the
    access tables, when there is authentication: without it every caller is anonymous)."""
    chain: list[grpc.aio.ServerInterceptor] = [
        RequestIdInterceptor(),
        LoggingInterceptor(logging.getLogger(f"relayrl.{service_name}.grpc")),
        MetricsInterceptor(registry, service_name),
    ]
    if authenticator is not None:
        chain.append(
            AuthInterceptor(authenticator, exempt_methods, access=access, roles_of=roles_of)
        )
    return chain
