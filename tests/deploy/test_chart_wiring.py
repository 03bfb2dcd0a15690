"""The Helm chart does not drift from the typed composition of the system (relayrl.stack).

A chart cannot run Python when it is installed, so its templates write the four service
configs themselves. For the default values and every ci/*-values.yaml, this test builds the
`Wiring` those values mean (the release's Service names, fixed ports, the TransferQueue, the
rollout knobs) and checks every rendered service config against it: each field the wiring
derives must be exactly what `Wiring.derive` gives, and the four configs together must pass
`StackConfig`'s checks that the services meet (same queue, eta, batch, targets, ports)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl.core.config import LoggingConfig, TlsClientConfig, deep_merge
from relayrl.gateway.config import KubernetesDiscoveryConfig
from relayrl.stack import (
    SERVICES,
    Endpoint,
    Endpoints,
    EngineDiscovery,
    Identities,
    RolloutShape,
    StackConfig,
    Wiring,
    as_file,
)
from relayrl.stack.config import CONFIG_CLASSES
from relayrl.tq.config import TQConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "relayrl"
SCENARIOS = (
    "default",
    *sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml")),
)
RELEASE, NAMESPACE = "rr-wiring", "relayrl-wiring"
GRPC_PORT, METRICS_PORT, REDIS_PORT = 50051, 9400, 6379
IDENTITY_DIR = Path("/etc/relayrl/identity")  # where the pods mount the identities Secret


def chart_values(scenario: str) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if scenario != "default":
        values = deep_merge(
            values, yaml.safe_load((CHART / "ci" / f"{scenario}-values.yaml").read_text())
        )
    return values


def fullname(values: dict[str, Any]) -> str:
    if values.get("fullnameOverride"):
        return str(values["fullnameOverride"])
    name = values.get("nameOverride") or "relayrl"
    return RELEASE if name in RELEASE else f"{RELEASE}-{name}"


def chart_wiring(values: dict[str, Any]) -> Wiring:
    """What the chart's values mean for the services, in the composition's terms."""
    domain = values["clusterDomain"]

    def host(component: str) -> str:
        return f"{fullname(values)}-{component}.{NAMESPACE}.svc.{domain}"

    redis, tls = values["redis"], values["tls"]
    redis_tls = None
    if redis["enabled"]:
        url, secret = f"redis://{host('redis')}:{REDIS_PORT}/0", True
        if tls["enabled"] and "redis" in tls["services"]:  # TLS only, with the mounted CA
            url = url.replace("redis://", "rediss://")
            peer = Path("/etc/relayrl/peer-tls/ca.crt"), Path("/etc/relayrl/peer-client")
            redis_tls = TlsClientConfig(
                ca_file=peer[0],
                cert_file=peer[1] / "tls.crt" if tls["mutual"] else None,
                key_file=peer[1] / "tls.key" if tls["mutual"] else None,
            )
    else:
        url, secret = redis["external"]["url"], bool(redis["external"].get("existingSecret"))
    t = values["training"]
    return Wiring(
        tq=TQConfig(
            url=url,
            tls=redis_tls,
            password_env="REDIS_PASSWORD" if secret else None,
            namespace=values["tq"]["namespace"],
            partitions=values["tq"]["partitions"],
            durability=values["tq"]["durability"],
        ),
        partition="train",
        model_path=Path(values["model"]["path"]),
        mode=t["mode"],
        parameter_sync_step=t["parameterSyncStep"],
        rollout_shape=RolloutShape(
            eta=t["eta"],
            batch_groups=t["trainBatchGroups"],
            samples_per_prompt=t["samplesPerPrompt"],
            max_tokens=t["maxTokens"],
        ),
        endpoints=Endpoints(
            **{
                s: Endpoint(
                    bind_host="0.0.0.0",
                    grpc_port=GRPC_PORT,
                    metrics_port=METRICS_PORT,
                    target=f"dns:///{host(s)}:{GRPC_PORT}",
                )
                for s in SERVICES
            }
        ),
        engines=EngineDiscovery(
            kubernetes=KubernetesDiscoveryConfig(
                service=f"{fullname(values)}-engine", namespace=NAMESPACE, port_name="http"
            )
        ),
        logging=LoggingConfig(level=values["logging"]["level"], json=values["logging"]["json"]),
        identities=Identities(
            tokens_file=IDENTITY_DIR / "tokens.yaml",
            token_files={
                p: IDENTITY_DIR / f"{p}.token" for p in ("trainer", "weightsync", "gateway")
            },
        )
        if values["security"]["authenticate"]
        else None,
    )


@pytest.fixture(scope="module")
def rendered_configs(deploy_tools: Any) -> Any:
    """scenario -> service -> the config file the chart renders for it."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for scenario in SCENARIOS:
        args = (
            [] if scenario == "default" else ["-f", str(CHART / "ci" / f"{scenario}-values.yaml")]
        )
        result = subprocess.run(
            [str(deploy_tools.helm), "template", RELEASE, str(CHART), "-n", NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{scenario}: {result.stderr}"
        out[scenario] = {
            doc["metadata"]["labels"]["app.kubernetes.io/component"]: yaml.safe_load(
                doc["data"]["config.yaml"]
            )
            for doc in yaml.safe_load_all(result.stdout)
            if doc and doc["kind"] == "ConfigMap" and "config.yaml" in doc.get("data", {})
        }
    return out


def drift(service: str, rendered: dict[str, Any], wiring: Wiring) -> list[str]:
    """The fields of `rendered` that differ from what the wiring derives, one line each."""
    cls = CONFIG_CLASSES[service]
    actual = cls.model_validate(rendered).model_dump(mode="json", by_alias=True)
    expected = cls.model_validate(deep_merge(rendered, as_file(wiring.derive(service)))).model_dump(
        mode="json", by_alias=True
    )
    return [
        f"{service}.{path}: chart {a!r}, composition {e!r}" for path, a, e in diff(actual, expected)
    ]


def diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            found
            for key in sorted(set(a) | set(b))
            for found in diff(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        ]
    return [] if a == b else [(path, a, b)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rendered_service_config_is_the_compositions_wiring(
    rendered_configs: Any, scenario: str
) -> None:
    configs = rendered_configs[scenario]
    wiring = chart_wiring(chart_values(scenario))
    problems = [line for s in SERVICES for line in drift(s, configs[s], wiring)]
    assert problems == [], "\n".join(problems)
    stack = StackConfig.model_validate({"wiring": wiring, **{s: configs[s] for s in SERVICES}})
    assert stack.trainer.rollout_shape == stack.gateway.rollout_shape == wiring.rollout_shape


def test_drift_is_caught(rendered_configs: Any) -> None:
    """A chart that wrote another eta into the gateway, or pointed the trainer at the wrong
    weight-sync, is reported with the field and both values."""
    configs = rendered_configs["default"]
    wiring = chart_wiring(chart_values("default"))
    gateway = deep_merge(configs["gateway"], {"rollout_shape": {"eta": 7}})
    assert drift("gateway", gateway, wiring) == [
        f"gateway.rollout_shape.eta: chart 7, composition {wiring.rollout_shape.eta!r}"
    ]
    target = "dns:///elsewhere:50051"
    trainer = deep_merge(configs["trainer"], {"publish": {"target": target}})
    (line,) = drift("trainer", trainer, wiring)
    assert line.startswith(f"trainer.publish.target: chart {target!r}, composition 'dns:///")
    with pytest.raises(ValueError, match=re.escape(f"trainer.publish.target is {target!r}")):
        StackConfig.model_validate(
            {"wiring": wiring, **{s: configs[s] for s in SERVICES}, "trainer": trainer}
        )
