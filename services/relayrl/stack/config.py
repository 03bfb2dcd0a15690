"""The whole system in one typed place: what the four services share (`Wiring`) and each
service's own config derived from it (`StackConfig`).

Every value two services must agree on -- the TransferQueue they meet in, the partition
trajectories flow through, where each service listens and how its peers dial it, the engines,
the policy model, the trainer's mode, the rollout shape (eta, groups per step, samples per
prompt, response budget: one model, relayrl.core.rollout_shape, that the trainer's and the
gateway's configs embed unchanged) -- is written once, in `Wiring`, and derived into each
service's sections by `Wiring.derive`, as the sections' own models. What belongs to one
service alone (its timeouts, paths, tuning) is that deployment's own business and is merged
over the derived part; a user's overrides come last. `StackConfig` then validates each service
with its own config class and checks that the four still agree (an override may break what
the wiring set up). Every error names its field.

Three deployments compose the system this way: `relayrl up` (relayrl.up.wiring), the pipeline
benchmark (bench/pipeline_bench.py) and the Helm chart, whose rendered service configs
tests/deploy/test_helm_chart.py checks against `Wiring.derive` for the same values (a chart
cannot run Python at install time, so it keeps its templates and a test holds them to this).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from relayrl.core.config import (
    GrpcClientConfig,
    GrpcServerConfig,
    LoggingConfig,
    MetricsConfig,
    StaticTokenAuthConfig,
    StrictModel,
    deep_merge,
    explain_error,
)
from relayrl.core.rollout_shape import RolloutShape
from relayrl.gateway.config import (
    EnginesConfig,
    GatewayConfig,
    KubernetesDiscoveryConfig,
    RolloutConfig,
)
from relayrl.reward.config import RewardConfig, TQScorerConfig
from relayrl.tq.config import TQConfig
from relayrl.trainer.config import (
    AlgorithmConfig,
    ModelConfig,
    PromptDataConfig,
    TrainerConfig,
    WeightSyncPublishConfig,
)
from relayrl.weightsync.config import WeightSyncConfig, WeightSyncEnginesConfig

ServiceName = Literal["reward", "gateway", "weightsync", "trainer"]
SERVICES: tuple[ServiceName, ...] = ("reward", "gateway", "weightsync", "trainer")
CONFIG_CLASSES: dict[str, type[StrictModel]] = {
    "reward": RewardConfig,
    "gateway": GatewayConfig,
    "weightsync": WeightSyncConfig,
    "trainer": TrainerConfig,
}


class StackError(ValueError):
    """A composition that does not validate; the message names the field."""


class Endpoint(StrictModel):
    """Where one service listens, and the gRPC target its peers dial."""

    bind_host: str = Field("127.0.0.1", min_length=1, description="Interface to bind.")
    grpc_port: int = Field(ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(ge=1, le=65535, description="Prometheus /metrics port.")
    target: str = Field(
        min_length=1,
        description="How peers dial it: host:port, or dns:///name:port in a cluster.",
    )

    @property
    def address(self) -> str:
        """host:port without a resolver scheme (what engines are told to dial)."""
        return self.target.removeprefix("dns:///")


class Endpoints(StrictModel):
    reward: Endpoint
    gateway: Endpoint
    weightsync: Endpoint
    trainer: Endpoint

    def of(self, service: str) -> Endpoint:
        endpoint: Endpoint = getattr(self, service)
        return endpoint


class EngineDiscovery(StrictModel):
    """How the gateway finds the engine replicas (it registers each with weight-sync)."""

    urls: list[str] = Field(default_factory=list, description="Static replica base URLs.")
    kubernetes: KubernetesDiscoveryConfig | None = Field(
        None, description="The ready endpoints of the engines' Service."
    )

    @model_validator(mode="after")
    def _some_engines(self) -> EngineDiscovery:
        if not self.urls and self.kubernetes is None:
            raise ValueError("engines: give urls or kubernetes discovery")
        return self


class Identities(StrictModel):
    """Who the services are to each other: the trainer, weight-sync and the gateway check
    their callers against one tokens file (principal -> token or its `sha256:` digest), and
    each calls its peers with its own token, so a service can act only in its own role
    (relayrl.core.access). The reward-service's callers are tenants: its `auth:` is each
    deployment's own (`relayrl up` gives it the same file, the chart the tenants' Secret)."""

    tokens_file: Path = Field(
        description="YAML principal -> token digest that every server authenticates against."
    )
    token_files: dict[str, Path] = Field(
        description="principal -> the file holding its own token: trainer, weightsync, gateway."
    )

    @model_validator(mode="after")
    def _callers(self) -> Identities:
        missing = sorted({"trainer", "weightsync", "gateway"} - set(self.token_files))
        if missing:
            raise ValueError(f"token_files needs an entry for {', '.join(missing)}")
        return self

    def client(self, principal: str) -> dict[str, Any]:
        """A client section's credentials for calls made as `principal` (to a gRPC peer, or
        to the engines, which check the same tokens file: relayrl.engine.guard)."""
        return {"token_file": str(self.token_files[principal])}


class Wiring(StrictModel):
    """Everything the services share, written once."""

    tq: TQConfig = Field(description="The TransferQueue every service meets in.")
    partition: str = Field("train", min_length=1, description="Where trajectories flow.")
    model_path: Path = Field(description="The policy's HF folder (tokenizer and weights).")
    mode: Literal["sync", "colocate_async", "separate_async"] = Field(
        "separate_async", description="Trainer mode (its table of modes checks the rest)."
    )
    parameter_sync_step: int = Field(1, ge=1, description="Local updates per version.")
    rollout_shape: RolloutShape = Field(
        description="Embedded unchanged in the trainer's and the gateway's configs."
    )
    endpoints: Endpoints
    engines: EngineDiscovery
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    identities: Identities | None = Field(
        None,
        description="Authentication between the services; null: every service accepts every "
        "caller (a private machine only).",
    )

    def derive(self, service: str) -> Sections:
        """The sections of `service`'s config that the wiring decides, each as its own
        validated model (`as_file` turns them into the file's part)."""
        return _DERIVE[service](self)

    # -- per service ----------------------------------------------------------------------

    def _base(self, service: str) -> Sections:
        e = self.endpoints.of(service)
        base: Sections = {
            "grpc": GrpcServerConfig(host=e.bind_host, port=e.grpc_port),
            "metrics": MetricsConfig(host=e.bind_host, port=e.metrics_port),
            "logging": self.logging,
        }
        if self.identities is not None and service != "reward":  # its callers are tenants
            base["auth"] = StaticTokenAuthConfig(
                type="static_token", tokens_file=self.identities.tokens_file
            )
        return base

    def _as(self, principal: str) -> dict[str, Any]:
        """What a client section adds to call as `principal` (nothing without identities)."""
        return {} if self.identities is None else self.identities.client(principal)

    def _client(self, peer: str, principal: str) -> GrpcClientConfig:
        return GrpcClientConfig(target=self.endpoints.of(peer).target, **self._as(principal))

    def _reward(self) -> Sections:
        return {
            **self._base("reward"),
            "tq": self.tq,
            "tq_scorer": TQScorerConfig(enabled=True, partitions=[self.partition]),
        }

    def _gateway(self) -> Sections:
        engines = self.engines
        return {
            **self._base("gateway"),
            "tq": self.tq,
            "tokenizer": self.model_path,
            "engines": EnginesConfig(
                urls=engines.urls,
                **({"kubernetes": engines.kubernetes} if engines.kubernetes else {}),
                **self._as("gateway"),
            ),
            "rollout": RolloutConfig(partitions=[self.partition]),
            "rollout_shape": self.rollout_shape,
            "weightsync": self._client("weightsync", "gateway"),
        }

    def _weightsync(self) -> Sections:
        return {
            **self._base("weightsync"),
            "advertise_target": self.endpoints.weightsync.address,
            "engines": WeightSyncEnginesConfig(**self._as("weightsync")),
            "gateway": self._client("gateway", "weightsync"),
        }

    def _trainer(self) -> Sections:
        return {
            **self._base("trainer"),
            "tq": self.tq,
            "rollout_shape": self.rollout_shape,
            "model": ModelConfig(hf_dir=self.model_path),
            "algorithm": AlgorithmConfig(
                mode=self.mode, parameter_sync_step=self.parameter_sync_step
            ),
            "data": PromptDataConfig(partition=self.partition),
            "publish": WeightSyncPublishConfig(
                type="weightsync",
                target=self.endpoints.weightsync.target,
                **self._as("trainer"),
            ),
            "gateway": self._client("gateway", "trainer"),
        }


# A part of a service's config: top-level key -> its section's model (or a plain value).
Sections = dict[str, Any]

_DERIVE: dict[str, Callable[[Wiring], Sections]] = {
    "reward": Wiring._reward,
    "gateway": Wiring._gateway,
    "weightsync": Wiring._weightsync,
    "trainer": Wiring._trainer,
}


def as_file(sections: Sections) -> dict[str, Any]:
    """Derived sections as a config file's part: each model with only the fields the wiring
    set (what a service would default is left to it)."""

    def plain(value: Any) -> Any:
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=True, exclude_unset=True)
        return str(value) if isinstance(value, Path) else value

    return {key: plain(value) for key, value in sections.items()}


class StackConfig(StrictModel):
    """The four services' configs, checked against the wiring and against each other."""

    wiring: Wiring
    reward: RewardConfig
    gateway: GatewayConfig
    weightsync: WeightSyncConfig
    trainer: TrainerConfig
    _files: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    @classmethod
    def compose(
        cls,
        wiring: Wiring,
        own: Mapping[str, Mapping[str, Any]] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        overrides_label: str = "services",
        hints: Mapping[str, str] | None = None,
    ) -> StackConfig:
        """Each service: what the wiring derives, then the deployment's `own` settings, then
        the user's `overrides` (deep merges). StackError names the first bad field, as
        `<overrides_label>.<service>.<field>`; `hints` say what to do instead of overriding
        a wiring field (see `Disagreement.message`)."""
        own, overrides = own or {}, overrides or {}
        unknown = sorted(set(own) - set(SERVICES)) + sorted(set(overrides) - set(SERVICES))
        if unknown:
            raise StackError(f"{overrides_label}.{unknown[0]}: not a service of {SERVICES}")
        files: dict[str, dict[str, Any]] = {}
        configs: dict[str, StrictModel] = {}
        for name in SERVICES:
            files[name] = deep_merge(
                deep_merge(as_file(wiring.derive(name)), dict(own.get(name, {}))),
                dict(overrides.get(name, {})),
            )
            try:
                configs[name] = CONFIG_CLASSES[name].model_validate(files[name])
            except ValidationError as exc:
                loc, message = explain_error(CONFIG_CLASSES[name], exc.errors()[0])
                where = ".".join([overrides_label, name, *map(str, loc)])
                raise StackError(f"{where}: {message}") from None
        # Every part is validated already; what is left is the check across them (the
        # validator's, with the deployment's hints).
        stack = cls.model_construct(wiring=wiring, **configs)
        found = disagreements(stack)
        if found:
            raise StackError(f"{overrides_label}.{found[0].message(hints)}")
        stack._files = files
        return stack

    def service_file(self, service: str) -> dict[str, Any]:
        """What `service`'s process is given as its config file: the merged sections, as
        written (defaults left to the service)."""
        if service in self._files:
            return self._files[service]
        config: StrictModel = getattr(self, service)
        return config.model_dump(mode="json", by_alias=True, exclude_unset=True)

    @model_validator(mode="after")
    def _services_agree(self) -> StackConfig:
        found = disagreements(self)
        if found:
            raise ValueError(found[0].message())
        return self


DEFAULT_HINT = "change it there, for every service at once"


@dataclass(frozen=True)
class Disagreement:
    """A service's field that contradicts the wiring: the services would not meet."""

    path: str  # the service's field, e.g. trainer.rollout_shape.eta
    actual: Any
    wiring_path: str  # the wiring's field it derives from, e.g. rollout_shape.eta
    expected: str  # what the wiring wants, as a phrase

    def message(self, hints: Mapping[str, str] | None = None) -> str:
        """One line; `hints` maps a wiring field (or its first part) to what the deployment's
        user should do instead (relayrl up: "set train.eta")."""
        hints = hints or {}
        hint = hints.get(self.wiring_path) or hints.get(self.wiring_path.split(".")[0])
        return (
            f"{self.path} is {self.actual!r} but the stack's {self.wiring_path} "
            f"{self.expected}; {hint or DEFAULT_HINT}"
        )


def disagreements(stack: StackConfig) -> list[Disagreement]:
    """Where the services' configs contradict the wiring, in a fixed order."""
    w, t, g = stack.wiring, stack.trainer, stack.gateway
    found: list[Disagreement] = []

    def differ(path: str, actual: Any, wiring_path: str, expected: Any) -> None:
        if actual != expected:
            found.append(Disagreement(path, actual, wiring_path, f"is {expected!r}"))

    for name in ("reward", "gateway", "trainer"):
        tq = getattr(stack, name).tq
        for key in ("url", "namespace", "password_env"):
            differ(f"{name}.tq.{key}", getattr(tq, key), f"tq.{key}", getattr(w.tq, key))
    differ("trainer.data.partition", t.data.partition, "partition", w.partition)
    for path, names in (
        ("gateway.rollout.partitions", g.rollout.partitions),
        ("reward.tq_scorer.partitions", stack.reward.tq_scorer.partitions),
        ("trainer.tq.partitions", t.tq.partitions),
    ):
        if w.partition not in names:
            found.append(Disagreement(path, names, "partition", f"{w.partition!r} is not in it"))
    for name in ("trainer", "gateway"):
        shape = getattr(stack, name).rollout_shape
        for key in RolloutShape.model_fields:
            differ(f"{name}.rollout_shape.{key}", getattr(shape, key),
                   f"rollout_shape.{key}", getattr(w.rollout_shape, key))  # fmt: skip
    differ("trainer.algorithm.mode", t.algorithm.mode, "mode", w.mode)
    differ("trainer.algorithm.parameter_sync_step", t.algorithm.parameter_sync_step,
           "parameter_sync_step", w.parameter_sync_step)  # fmt: skip
    differ("gateway.tokenizer", g.tokenizer, "model_path", w.model_path)
    differ("trainer.model.hf_dir", t.model.hf_dir, "model_path", w.model_path)
    clients: dict[str, tuple[Any, str]] = {
        "gateway.weightsync.target": (g.weightsync, "weightsync"),
        "trainer.gateway.target": (t.gateway, "gateway"),
        "weightsync.gateway.target": (stack.weightsync.gateway, "gateway"),
    }
    if isinstance(t.publish, WeightSyncPublishConfig):
        clients["trainer.publish.target"] = (t.publish, "weightsync")
    for path, (client, peer) in clients.items():
        target = getattr(client, "target", None)
        differ(path, target, f"endpoints.{peer}.target", w.endpoints.of(peer).target)
    if w.identities is not None:
        for name in ("gateway", "weightsync", "trainer"):
            auth = getattr(stack, name).auth
            differ(f"{name}.auth.type", auth.type, "identities", "static_token")
    for name in SERVICES:
        config, endpoint = getattr(stack, name), w.endpoints.of(name)
        for kind, port, expected in (
            ("grpc", config.grpc.port, endpoint.grpc_port),
            ("metrics", config.metrics.port, endpoint.metrics_port),
        ):
            differ(f"{name}.{kind}.port", port, f"endpoints.{name}.{kind}_port", expected)
    return found
