"""Typed service configuration: a YAML file, then environment overrides, then validation.

Every service's config is a tree of `StrictModel`s (unknown keys are errors, every field has a
description and bounds). `load_config` is the one way to build it, so a deployment can set any
field from a Helm value, a mounted file or an environment variable, and every mistake ends in a
`ConfigError` whose single line names the file or variable and the field path:

    config.yaml: grpc.port: Input should be less than or equal to 65535
    env RELAYRL_REWARD__GRPC__PROT: unknown field grpc.prot (known: host, port, ...)

Environment overrides are `<PREFIX>__A__B=value`: double underscores separate nesting levels,
field names match case-insensitively, and values are parsed as YAML scalars (`8080`, `true`,
`[a, b]`), except that fields typed as strings keep the raw text (a host named `0` stays "0").

This module imports nothing heavier than pydantic and PyYAML, so `--help` stays instant.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

MIB = 1024 * 1024
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # gRPC core stores message limits in a signed 32-bit int
MIN_TOKEN_CHARS = 16
TOKEN_DIGEST_PREFIX = "sha256:"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
REFLECTION_METHODS = (
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)
DEFAULT_EXEMPT_METHODS = (*HEALTH_METHODS, *REFLECTION_METHODS)

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A user mistake in a config file or environment override; the message is one line that
    names the file or variable and the field path, so it can be fixed without reading code."""


class StrictModel(BaseModel):
    """Base of every config section: a misspelt key is an error, not a silently ignored one.

    A section whose key moved lists it in `renamed_keys` (old key -> where it went, relative
    to the section, or from the file's top with a leading `/`): the old key stays an error,
    whose message names the new one. Nothing has been released, so a move is not kept working
    under its old name."""

    model_config = ConfigDict(extra="forbid")
    renamed_keys: ClassVar[dict[str, str]] = {}


class TlsServerConfig(StrictModel):
    """TLS on the gRPC listener (`grpc.tls:`); with `client_ca_file` and
    `require_client_cert`, mutual TLS: only clients holding a certificate signed by that CA
    get through the handshake (and `auth.type: mtls` names them by certificate)."""

    cert_file: Path = Field(description="PEM server certificate chain (a mounted Secret).")
    key_file: Path = Field(description="PEM private key of the server certificate.")
    client_ca_file: Path | None = Field(
        None, description="PEM CA bundle that client certificates must chain to."
    )
    require_client_cert: bool = Field(
        False, description="Refuse clients without a valid certificate (mutual TLS)."
    )

    @model_validator(mode="after")
    def _ca_for_clients(self) -> TlsServerConfig:
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file to check them against")
        return self


class GrpcKeepaliveConfig(StrictModel):
    """HTTP/2 keepalive pings on a gRPC connection (`keepalive:`): how a silent peer -- a
    partition, a half-open connection, a host that vanished without closing anything -- is
    noticed, also while a long call waits for its answer. A ping goes out every `time_s`; one
    unanswered for `timeout_s` closes the connection and fails its calls with UNAVAILABLE, so
    a peer that went silent is given up within `silent_peer_s` (docs/recovery.md#silent-peers).
    A deadline bounds a call; this bounds the connection under it."""

    time_s: float = Field(
        20.0,
        ge=1.0,
        le=3600.0,
        description="Interval of keepalive pings, with or without calls in flight.",
    )
    timeout_s: float = Field(
        10.0,
        ge=0.1,
        le=3600.0,
        description="How long a ping may go unanswered before the connection is closed.",
    )

    @property
    def silent_peer_s(self) -> float:
        """The longest a silent peer goes unnoticed: one interval, then one ping's timeout."""
        return self.time_s + self.timeout_s


class TcpKeepaliveConfig(StrictModel):
    """TCP keepalive on a plain TCP connection (`tcp_keepalive:`), for the links that have no
    pings of their own (HTTP): after `idle_s` without traffic the kernel probes the peer every
    `interval_s` and closes the connection after `probes` unanswered probes, and data left
    unacknowledged as long closes it too. So a silent peer -- a partition, a half-open
    connection, a host that vanished -- fails the call waiting on it within `silent_peer_s`,
    however long the call's own deadline (docs/recovery.md#silent-peers). The peer's kernel
    answers probes even while its process is too busy to run: a loaded peer is never taken
    for a dead one."""

    idle_s: int = Field(
        10, ge=1, le=7200, description="Seconds without traffic before the first probe."
    )
    interval_s: int = Field(5, ge=1, le=600, description="Seconds between probes.")
    probes: int = Field(
        3, ge=1, le=20, description="Unanswered probes after which the connection is closed."
    )

    @property
    def silent_peer_s(self) -> int:
        """The longest a silent peer goes unnoticed."""
        return self.idle_s + self.interval_s * self.probes


class HttpLinkConfig(StrictModel):
    """How an HTTP client notices a silent server (`http:`): a bound on opening the
    connection, and TCP keepalive on it while a request waits."""

    connect_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="Longest wait for the TCP connection to open (a dropped SYN, a server "
        "whose backlog is full).",
    )
    tcp_keepalive: TcpKeepaliveConfig = Field(
        default_factory=TcpKeepaliveConfig,
        description="Probes that close a connection whose server went silent, also while a "
        "long request (a generation) waits for its answer.",
    )


# the two keepalive keys became the `keepalive:` section (GrpcKeepaliveConfig)
_KEEPALIVE_MOVED = {
    "keepalive_time_s": "keepalive.time_s",
    "keepalive_timeout_s": "keepalive.timeout_s",
}


class GrpcServerConfig(StrictModel):
    """How a service's gRPC server listens (`grpc:` section)."""

    renamed_keys = _KEEPALIVE_MOVED

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Interface to bind. 127.0.0.1 keeps a local run private; use 0.0.0.0 (or ::) "
        "in a pod.",
    )
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one (logged).")
    max_message_bytes: int = Field(
        64 * MIB,
        ge=1024,
        le=MAX_GRPC_MESSAGE_BYTES,
        description="Largest message sent or received; trajectories and weight buckets are big.",
    )
    keepalive: GrpcKeepaliveConfig = Field(
        default_factory=GrpcKeepaliveConfig,
        description="The server's own pings to its clients: a client that went silent is "
        "dropped and its calls cancelled.",
    )
    min_ping_interval_s: float = Field(
        10.0,
        ge=0.0,
        le=3600.0,
        description="Shortest client ping interval accepted without data; clients pinging "
        "faster are sent GOAWAY (too_many_pings). Keep it <= the clients' keepalive.time_s.",
    )
    keepalive_permit_without_calls: bool = Field(
        True, description="Accept and send keepalive pings while no call is active."
    )
    grace_s: float = Field(
        10.0,
        ge=0.0,
        le=3600.0,
        description="On SIGTERM, how long in-flight calls may run before they are cancelled. "
        "Keep it below the pod's terminationGracePeriodSeconds.",
    )
    max_concurrent_rpcs: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Calls beyond this many in flight are rejected with RESOURCE_EXHAUSTED; "
        "null means unlimited.",
    )
    tls: TlsServerConfig | None = Field(
        None, description="Serve TLS (or mutual TLS); null: plaintext (a mesh may add TLS)."
    )


class TlsClientConfig(StrictModel):
    """TLS towards a peer (`tls:` of a client section): the CA its certificate must chain to,
    and for mutual TLS this caller's own certificate (whose CN names it to an `mtls` peer)."""

    ca_file: Path = Field(description="PEM CA bundle the peer's certificate must chain to.")
    cert_file: Path | None = Field(
        None, description="PEM client certificate chain (mutual TLS); with key_file."
    )
    key_file: Path | None = Field(None, description="PEM private key of cert_file.")
    server_name: str | None = Field(
        None,
        min_length=1,
        description="Name to check the peer's certificate against, when it differs from the "
        "target's host (e.g. a certificate issued for the Service's DNS name, dialled by IP).",
    )

    @model_validator(mode="after")
    def _pair(self) -> TlsClientConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "give both cert_file and key_file for a client certificate, or neither"
            )
        return self


class TokenSourceConfig(StrictModel):
    """Where this caller's bearer token comes from (none: it calls anonymously, which a peer
    with authentication refuses)."""

    token_file: Path | None = Field(
        None,
        description="File holding this caller's bearer token (a mounted Secret), sent as "
        "`authorization: Bearer <token>`.",
    )
    token_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding this caller's bearer token.",
    )

    @model_validator(mode="after")
    def _one_token_source(self) -> TokenSourceConfig:
        if self.token_file is not None and self.token_env is not None:
            raise ValueError("set token_file or token_env, not both")
        return self


class ClientCredentialsConfig(TokenSourceConfig):
    """How this caller proves who it is to a gRPC peer: TLS (mutual, for an `mtls` peer)
    and/or a bearer token for a `static_token` peer. Neither: plaintext and anonymous."""

    tls: TlsClientConfig | None = Field(
        None, description="TLS towards the peer; null: plaintext (a mesh may add TLS)."
    )


class GrpcClientConfig(ClientCredentialsConfig):
    """How a service calls another one (a peer's section, e.g. `weightsync_client:`)."""

    renamed_keys = _KEEPALIVE_MOVED

    target: str = Field(min_length=1, description="gRPC target, e.g. `dns:///weightsync:50051`.")
    max_message_bytes: int = Field(
        64 * MIB,
        ge=1024,
        le=MAX_GRPC_MESSAGE_BYTES,
        description="Largest message sent or received.",
    )
    keepalive: GrpcKeepaliveConfig = Field(
        default_factory=GrpcKeepaliveConfig,
        description="Pings that notice a silent peer while a call waits or the channel idles; "
        "keepalive.time_s must be >= the server's grpc.min_ping_interval_s.",
    )
    default_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=86_400.0,
        description="Deadline given to a call that sets none: no call waits forever.",
    )


class MetricsConfig(StrictModel):
    """Where the service serves Prometheus `/metrics` (`metrics:` section)."""

    enabled: bool = Field(True, description="Serve /metrics over HTTP.")
    host: str = Field("127.0.0.1", min_length=1, description="Interface to bind; 0.0.0.0 in a pod.")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one (logged).")


class RolesConfig(StrictModel):
    """What each authenticated principal may do: a server allows each of its methods to some
    roles (see the service's access table); a principal's roles are those listed for it under
    `roles`, else its own name (so principals named `trainer`, `weightsync`, `gateway`,
    `engine`, `operator`, `agent` need no entry)."""

    roles: dict[str, list[str]] = Field(
        default_factory=dict,
        description="principal -> the roles it acts in, e.g. `{alice-ops: [operator]}`.",
    )

    def roles_of(self, principal: str) -> frozenset[str]:
        return frozenset(self.roles.get(principal, [principal]))


class NoAuthConfig(StrictModel):
    """Every caller is accepted (local runs, or a mesh that authenticates for us)."""

    type: Literal["none"] = Field("none", description="Authentication backend.")


class StaticTokenAuthConfig(RolesConfig):
    """Callers send `authorization: Bearer <token>`; each token names one principal.

    The principal -> token mapping comes from exactly one of: a YAML file (a mounted Secret),
    an environment variable holding the same YAML mapping, or inline `tokens` (works, but puts
    secrets into the config file; a warning is logged). A value may be the token itself or
    `sha256:<hex digest of the token>`, so that the server never holds its callers' tokens."""

    type: Literal["static_token"] = Field(description="Authentication backend.")
    tokens_file: Path | None = Field(
        None, description="YAML file with a mapping principal -> token."
    )
    tokens_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding a YAML mapping principal -> token, e.g. "
        "`{alice: s3cr3t...}`.",
    )
    tokens: dict[str, SecretStr] | None = Field(
        None, description="Inline mapping principal -> token (discouraged: secrets in config)."
    )
    exempt_methods: list[str] = Field(
        default_factory=lambda: list(DEFAULT_EXEMPT_METHODS),
        description="Full method names (`/pkg.Service/Method`, or `/pkg.Service/*`) callable "
        "without a token; health and reflection by default so probes keep working.",
    )

    @field_validator("exempt_methods")
    @classmethod
    def _method_names(cls, methods: list[str]) -> list[str]:
        for method in methods:
            if not method.startswith("/") or method.count("/") != 2:
                raise ValueError(
                    f"{method!r} is not a full method name; write /package.Service/Method "
                    "or /package.Service/*"
                )
        return methods

    @model_validator(mode="after")
    def _one_source(self) -> StaticTokenAuthConfig:
        sources = [
            name
            for name in ("tokens_file", "tokens_env", "tokens")
            if getattr(self, name) is not None
        ]
        if len(sources) != 1:
            raise ValueError(
                "set exactly one of tokens_file, tokens_env or tokens "
                f"(got {', '.join(sources) or 'none'})"
            )
        return self


class MtlsAuthConfig(RolesConfig):
    """Callers are named by the common name (CN) of their client certificate; needs
    `grpc.tls` with `client_ca_file` and `require_client_cert: true`."""

    type: Literal["mtls"] = Field(description="Authentication backend.")
    principals: list[str] | None = Field(
        None,
        description="Certificate CNs accepted; null: any certificate signed by the client CA.",
    )


AuthConfig = Annotated[
    NoAuthConfig | StaticTokenAuthConfig | MtlsAuthConfig, Field(discriminator="type")
]


class LoggingConfig(StrictModel):
    """How the service logs (`logging:` section)."""

    # `json` is the YAML key; the attribute is json_lines because BaseModel.json exists.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="Lowest level written (case-insensitive)."
    )
    json_lines: bool = Field(
        False,
        alias="json",
        description="One JSON object per line (for log shippers) instead of plain text.",
    )

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, level: object) -> object:
        return level.upper() if isinstance(level, str) else level


class ServiceConfig(StrictModel):
    """Sections every service has; a service's config subclasses this and adds its own."""

    grpc: GrpcServerConfig = Field(
        default_factory=GrpcServerConfig, description="gRPC server listener."
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Prometheus /metrics endpoint."
    )
    auth: AuthConfig = Field(
        default_factory=NoAuthConfig, description="How callers authenticate (by `type`)."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Log output.")

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServiceConfig:
        if (
            self.metrics.enabled
            and self.grpc.port != 0
            and self.grpc.port == self.metrics.port
            and self.grpc.host == self.metrics.host
        ):
            raise ValueError(
                f"grpc.port and metrics.port are both {self.grpc.port} on {self.grpc.host}; "
                "give them different ports"
            )
        tls = self.grpc.tls
        if isinstance(self.auth, MtlsAuthConfig) and (tls is None or not tls.require_client_cert):
            raise ValueError(
                "auth.type mtls needs grpc.tls with client_ca_file and require_client_cert: true"
            )
        return self


# --- loading ---------------------------------------------------------------------------------


def load_config(
    model_cls: type[ModelT],
    path: str | Path | None,
    env_prefix: str,
    environ: Mapping[str, str] = os.environ,
) -> ModelT:
    """Build `model_cls` from the YAML at `path` (None or "" → defaults), then the
    `<env_prefix>__...` variables in `environ`; raise ConfigError for any user mistake."""
    if not env_prefix or "__" in env_prefix:
        raise ValueError(f"env_prefix must be non-empty without '__', got {env_prefix!r}")
    file_label = str(path) if path else "config"
    data = _read_yaml_file(Path(path)) if path else {}
    sources = _apply_env_overrides(model_cls, data, env_prefix, environ)
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe_errors(model_cls, exc, file_label, sources)) from None


def dump_config(model: BaseModel) -> str:
    """The effective config as YAML (secrets masked), for `--print-config` and logs."""
    return yaml.safe_dump(
        model.model_dump(mode="json", by_alias=True), sort_keys=False, allow_unicode=True
    )


def _read_yaml_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    data = _parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def _parse_yaml(text: str, label: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{label}: invalid YAML{where}: {problem}") from None


# --- environment overrides -------------------------------------------------------------------
# pydantic-settings' `env_nested_delimiter` was weighed against these and not taken, because
# its errors name the field but never the variable, it reads lists as JSON (`[a, b]` fails
# with "error parsing value for field auth"), leaves `null` a string, lowercases mapping keys
# (`TOKENS__Alice` becomes `alice`) and reads only os.environ.


def _apply_env_overrides(
    model_cls: type[BaseModel],
    data: dict[str, Any],
    env_prefix: str,
    environ: Mapping[str, str],
) -> dict[tuple[str, ...], str]:
    """Write every `<prefix>__...` variable into `data`; return field path → variable name so
    validation errors can name the variable that caused them."""
    marker = env_prefix + "__"
    sources: dict[tuple[str, ...], str] = {}
    for key in sorted(k for k in environ if k.startswith(marker)):
        label = f"env {key}"
        parts = key[len(marker) :].split("__")
        if not all(parts):
            raise ConfigError(f"{label}: empty field name (a '___' or trailing '__'?)")
        field_path, annotation = _resolve_env_path(model_cls, parts, label)
        _set_nested(data, field_path, _env_value(environ[key], annotation, label))
        sources[field_path] = key
    return sources


def _resolve_env_path(
    model_cls: type[BaseModel], parts: list[str], label: str
) -> tuple[tuple[str, ...], Any]:
    path: list[str] = []
    annotation: Any = model_cls
    for part in parts:
        models = _models_in(annotation)
        if models:
            name, annotation = _match_field(models, part, path, label)
            path.append(name)
        elif (value_type := _mapping_value_type(annotation)) is not None:
            path.append(part)
            annotation = value_type
        else:
            raise ConfigError(f"{label}: {'.'.join(path)} has no sub-field {part.lower()!r}")
    return tuple(path), annotation


def _match_field(
    models: list[type[BaseModel]], part: str, path: list[str], label: str
) -> tuple[str, Any]:
    known: list[str] = []
    for model in models:
        for name, info in model.model_fields.items():
            names = {name.lower()} | ({info.alias.lower()} if info.alias else set())
            if part.lower() in names:
                return info.alias or name, info.annotation
            known.append(info.alias or name)
    dotted = ".".join([*path, part.lower()])
    unique = ", ".join(dict.fromkeys(known))
    raise ConfigError(f"{label}: unknown field {dotted} (known: {unique})")


def _env_value(raw: str, annotation: Any, label: str) -> Any:
    """Parse as a YAML scalar so numbers, booleans and lists work; keep raw text for string
    fields because YAML would turn `0123` or `yes` into a number or a boolean."""
    if _is_string_field(annotation) and not (_allows_none(annotation) and raw in ("null", "~")):
        return raw
    if raw == "":
        return ""
    return _parse_yaml(raw, label)


def _set_nested(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = data
    for name in path[:-1]:
        child = node.get(name)
        if not isinstance(child, dict):
            child = {}
            node[name] = child
        node = child
    node[path[-1]] = value


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of an annotation, without Annotated/Optional wrappers."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) for alt in _unwrap(arg)]
    return [annotation]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    return [
        alt for alt in _unwrap(annotation) if isinstance(alt, type) and issubclass(alt, BaseModel)
    ]


def _mapping_value_type(annotation: Any) -> Any | None:
    for alt in _unwrap(annotation):
        if typing.get_origin(alt) in (dict, Mapping):
            return typing.get_args(alt)[1]
    return None


def _allows_none(annotation: Any) -> bool:
    return type(None) in _unwrap(annotation)


def _is_string_field(annotation: Any) -> bool:
    alts = [alt for alt in _unwrap(annotation) if alt is not type(None)]
    return bool(alts) and all(alt in (str, Path, SecretStr) for alt in alts)


# --- error messages --------------------------------------------------------------------------


def _describe_errors(
    model_cls: type[BaseModel],
    exc: ValidationError,
    file_label: str,
    sources: dict[tuple[str, ...], str],
) -> str:
    """One line per config, `source: field.path: message`, errors joined with '; '."""
    lines = []
    for error in exc.errors(include_url=False):
        loc, message = explain_error(model_cls, error)
        source = _source_of(loc, file_label, sources)
        if loc:
            lines.append(f"{source}: {'.'.join(str(part) for part in loc)}: {message}")
        else:  # a check across sections: its message names the fields
            lines.append(f"{source}: {message}")
    return "; ".join(lines)


def explain_error(model_cls: type[BaseModel], error: Any) -> tuple[tuple[int | str, ...], str]:
    """One of pydantic's errors for `model_cls` as (the YAML keys' path, what to fix): an
    unknown key that a section renamed says where it went."""
    loc = _field_loc(model_cls, error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = _extra_key_message(model_cls, loc, message)
    return loc, message


def _field_loc(model_cls: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop the discriminator tags pydantic puts into locations of tagged unions
    (`auth.static_token.tokens_file` → `auth.tokens_file`), which are not YAML keys."""
    cleaned: list[int | str] = []
    annotation: Any = model_cls
    for part in loc:
        models = _models_in(annotation)
        if len(models) > 1 and part in _tags(models):
            annotation = _tags(models)[part]
            continue
        cleaned.append(part)
        annotation = _child_annotation(annotation, part)
    return tuple(cleaned)


def _tags(models: list[type[BaseModel]]) -> dict[Any, type[BaseModel]]:
    tags: dict[Any, type[BaseModel]] = {}
    for model in models:
        info = model.model_fields.get("type")
        if info is not None and typing.get_origin(info.annotation) is Literal:
            tags.update(dict.fromkeys(typing.get_args(info.annotation), model))
    return tags


def _child_annotation(annotation: Any, part: int | str) -> Any:
    for model in _models_in(annotation):
        for name, info in model.model_fields.items():
            if part in (name, info.alias):
                return info.annotation
    for alt in _unwrap(annotation):
        args = typing.get_args(alt)
        if typing.get_origin(alt) in (dict, Mapping):
            return args[1]
        if typing.get_origin(alt) in (list, tuple) and args:
            return args[0]
    return None


def _extra_key_message(model_cls: type[BaseModel], loc: tuple[int | str, ...], message: str) -> str:
    """An unknown key's message: where it moved, if its section renamed it; else the keys
    the section knows."""
    annotation: Any = model_cls
    for part in loc[:-1]:
        annotation = _child_annotation(annotation, part)
    models = _models_in(annotation)
    for model in models:
        moved = getattr(model, "renamed_keys", {}).get(str(loc[-1]))
        if moved is not None:
            if moved.startswith("/"):
                return f"moved to {moved[1:]}"
            return f"renamed to {'.'.join(map(str, (*loc[:-1], *moved.split('.'))))}"
    names = [info.alias or name for model in models for name, info in model.model_fields.items()]
    return message + (f" (known: {', '.join(dict.fromkeys(names))})" if names else "")


def _source_of(
    loc: tuple[int | str, ...], file_label: str, sources: dict[tuple[str, ...], str]
) -> str:
    for length in range(len(loc), 0, -1):
        if (key := sources.get(tuple(str(p) for p in loc[:length]))) is not None:
            return f"env {key}"
    below = [key for path, key in sources.items() if path[: len(loc)] == tuple(map(str, loc))]
    return f"{file_label} (with env {', '.join(below)})" if below else file_label


# --- static tokens ---------------------------------------------------------------------------


def load_client_token(
    config: TokenSourceConfig, label: str, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The bearer token a client section names (None without one); ConfigError naming
    `label` (the section, e.g. `publish`) when it cannot be read or is too weak."""
    if config.token_env is not None:
        where = f"env {config.token_env} ({label}.token_env)"
        if config.token_env not in environ:
            raise ConfigError(f"{where}: variable is not set")
        token = environ[config.token_env].strip()
    elif config.token_file is not None:
        where = f"{config.token_file} ({label}.token_file)"
        try:
            token = config.token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read: {exc.strerror}") from None
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(
            f"{where}: the token must be at least {MIN_TOKEN_CHARS} characters without whitespace"
        )
    return token


def load_static_tokens(
    config: StaticTokenAuthConfig, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """Resolve the principal → token mapping from the configured source; raise ConfigError
    naming the source when it is missing, not a mapping, or holds weak or shared tokens."""
    if config.tokens is not None:
        return _check_tokens(
            {name: secret.get_secret_value() for name, secret in config.tokens.items()},
            "auth.tokens",
        )
    if config.tokens_env is not None:
        label = f"env {config.tokens_env} (auth.tokens_env)"
        if config.tokens_env not in environ:
            raise ConfigError(f"{label}: variable is not set")
        return _check_tokens(_parse_yaml(environ[config.tokens_env], label), label)
    assert config.tokens_file is not None  # guaranteed by StaticTokenAuthConfig._one_source
    label = f"{config.tokens_file} (auth.tokens_file)"
    try:
        text = config.tokens_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror}") from None
    return _check_tokens(_parse_yaml(text, label), label)


def _check_tokens(mapping: Any, label: str) -> dict[str, str]:
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(f"{label}: expected a non-empty mapping principal -> token")
    seen: dict[str, str] = {}
    for principal, token in mapping.items():
        if not isinstance(principal, str) or not principal:
            raise ConfigError(f"{label}: principal names must be non-empty strings")
        if not isinstance(token, str):
            raise ConfigError(f"{label}: token of {principal!r} must be a string (quote it)")
        if token.startswith(TOKEN_DIGEST_PREFIX):
            if not _SHA256_HEX.fullmatch(token.removeprefix(TOKEN_DIGEST_PREFIX)):
                raise ConfigError(
                    f"{label}: digest of {principal!r} must be {TOKEN_DIGEST_PREFIX} and 64 "
                    "lowercase hex digits"
                )
        elif len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise ConfigError(
                f"{label}: token of {principal!r} must be at least {MIN_TOKEN_CHARS} "
                "characters without whitespace"
            )
        if token in seen:
            raise ConfigError(
                f"{label}: {principal!r} and {seen[token]!r} share a token; give each "
                "principal its own"
            )
        seen[token] = principal
    return dict(mapping)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`: nested dicts merge, anything else replaces."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
