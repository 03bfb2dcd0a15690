"""What relayrl's services and the vLLM engine really export, and which metrics a PromQL
expression reads: the shared ground for the dashboard, alert-rule and metrics-reference checks
(and for a test that runs the same queries against a live Prometheus).

The service inventory is derived from the code, never from a hand-written list: every service's
metrics objects are built on a fresh CollectorRegistry exactly as the service builds them (its
metrics class, the gRPC interceptor chain, the TransferQueue collector the trainer registers,
read against a real redis-server), and the exposed sample names come from `registry.collect()`.
The engine's `vllm:*` names come from a real vLLM engine's /metrics.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import promql_parser
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from relayrl.tq import TransferQueue

SERVICES = ("gateway", "reward", "trainer", "weightsync")
ENGINE = "engine"
# Series Prometheus itself makes: scrape health and the state of alerts.
BUILTIN_SERIES = frozenset({"up", "ALERTS"})
# Labels Prometheus or the histogram/summary encoding adds to samples; not a family's own labels.
_ENCODING_LABELS = frozenset({"le", "quantile"})

# The suffixes each metric type adds to a family name in the text exposition format.
_SUFFIXES: Mapping[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "stateset": ("",),
    "unknown": ("",),
}


@dataclass(frozen=True)
class Family:
    """One metric family as a scrape shows it."""

    component: str
    name: str  # the family name (a counter's without `_total`)
    type: str
    documentation: str
    labels: tuple[str, ...]
    samples: frozenset[str]  # every sample name the family can expose

    @property
    def query_name(self) -> str:
        """The name a query uses for the family: `_total` for counters, the base name for
        histograms (queried through `_bucket`/`_sum`/`_count`), the name otherwise."""
        return self.name + "_total" if self.type == "counter" else self.name


def _sample_names(name: str, type_: str) -> frozenset[str]:
    return frozenset(name + suffix for suffix in _SUFFIXES.get(type_, ("",)))


def _declared_labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Label names of the registry's labelled metric objects, by family name (a labelled
    metric without children exposes no samples, so its labels are read off the object)."""
    labels: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):  # no public accessor
        if isinstance(collector, MetricWrapperBase):
            labels[collector._name] = tuple(collector._labelnames)
    return labels


def _family(component: str, metric: Metric, labels: tuple[str, ...]) -> Family:
    return Family(
        component=component,
        name=metric.name,
        type=metric.type,
        documentation=metric.documentation,
        labels=labels,
        samples=_sample_names(metric.name, metric.type) | {s.name for s in metric.samples},
    )


def families_from_registry(component: str, registry: CollectorRegistry) -> list[Family]:
    declared = _declared_labels(registry)
    out = []
    for metric in registry.collect():
        sample_labels = {
            label for s in metric.samples for label in s.labels if label not in _ENCODING_LABELS
        }
        # custom collectors' families (the TransferQueue's) keep their label names
        own = declared.get(metric.name) or getattr(metric, "_labelnames", ())
        out.append(_family(component, metric, tuple(own) or tuple(sorted(sample_labels))))
    return out


def build_service_registries(tq: TransferQueue) -> dict[str, CollectorRegistry]:
    """Each service's registry as the service fills it: its metrics class, the standard gRPC
    interceptor chain (relayrl.core.grpc_server builds every service with it), and for the
    trainer the TransferQueue collector it registers (reading `tq`)."""
    from relayrl.core.interceptors import server_interceptors
    from relayrl.gateway.metrics import GatewayMetrics
    from relayrl.reward.metrics import RewardMetrics
    from relayrl.tq.metrics import TQCollector
    from relayrl.trainer.metrics import TrainerMetrics
    from relayrl.weightsync.metrics import WeightSyncMetrics

    registries = {service: CollectorRegistry() for service in SERVICES}
    for service, registry in registries.items():
        server_interceptors(service, registry)
    GatewayMetrics(registries["gateway"])
    RewardMetrics(registries["reward"])
    TrainerMetrics(registries["trainer"], staleness_bound_steps=2)
    WeightSyncMetrics(registries["weightsync"])
    registries["trainer"].register(TQCollector(tq, "trainer", [tq.partitions()[0]], lambda: 1))
    return registries


_SERVICE_FAMILIES: list[Family] = []


def service_families(workdir: Path) -> list[Family]:
    """Every family the four services export, with the TransferQueue collector reading a
    private redis-server (started in `workdir`, stopped by PID before returning). Built once
    per test session; the collector must have answered, or its families would be missing."""
    if _SERVICE_FAMILIES:
        return list(_SERVICE_FAMILIES)
    from relayrl.tq.server import RedisServer

    server = RedisServer(workdir / "redis")
    server.start()
    try:
        tq = TransferQueue(server.client())
        tq.create_partition("train")
        families: list[Family] = []
        for service, registry in build_service_registries(tq).items():
            families.extend(families_from_registry(service, registry))
            if service == "trainer":
                assert registry.get_sample_value("relayrl_trainer_tq_up_bool") == 1, (
                    "the TransferQueue collector did not read Redis; its families are missing"
                )
        tq.close()
    finally:
        server.kill()
    _SERVICE_FAMILIES.extend(families)
    return families


def families_from_text(component: str, text: str) -> list[Family]:
    """Families of a real /metrics scrape in the Prometheus text format."""
    out = []
    for metric in text_string_to_metric_families(text):
        labels = {
            label for s in metric.samples for label in s.labels if label not in _ENCODING_LABELS
        }
        out.append(_family(component, metric, tuple(sorted(labels))))
    return out


def scrape_engine_metrics(engine_url: str) -> str:
    """The /metrics text of a real vLLM engine (the test session's), after one completion of
    its own (so request histograms hold data)."""
    body = b'{"model": "policy", "prompt": [1, 5, 6, 7], "max_tokens": 4}'
    request = urllib.request.Request(
        f"{engine_url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    with urllib.request.urlopen(f"{engine_url}/metrics", timeout=30) as response:
        return response.read().decode()


def exported_series(families: Iterable[Family]) -> dict[str, set[str]]:
    """Sample name -> the components that expose it."""
    out: dict[str, set[str]] = {}
    for family in families:
        for name in family.samples:
            out.setdefault(name, set()).add(family.component)
    return out


# --- PromQL ----------------------------------------------------------------------------------

# Grafana's interval variables, and the value a check substitutes for them.
GRAFANA_INTERVALS = {
    "__rate_interval": "1m",
    "__interval": "30s",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "30000",
}
_GRAFANA_VARIABLE = re.compile(
    r"\$\{(?P<braced>\w+)(?::(?P<format>\w+))?\}|\[\[(?P<old>\w+)\]\]|\$(?P<plain>\w+)"
)


def substitute_grafana_variables(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with every Grafana variable ($var, ${var}, ${var:format}, [[var]]) replaced by a
    concrete value: interval built-ins by a duration, dashboard variables from `values`. A
    variable that is neither is a KeyError naming it (a typo or an undefined variable)."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("old") or match.group("plain")
        if name in GRAFANA_INTERVALS:
            return GRAFANA_INTERVALS[name]
        if name not in values:
            raise KeyError(f"Grafana variable ${name} is not defined by the dashboard")
        return values[name]

    return _GRAFANA_VARIABLE.sub(replace, expr)


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects. Raises ValueError for an expression that does not
    parse, and for a selector whose name is a regex or missing (its metrics cannot be
    checked)."""
    return {selector.name for selector in selectors(expr)}


def unknown_metrics(expr: str, exported: Mapping[str, object]) -> set[str]:
    """Names `expr` reads that no component exports (and that are not Prometheus built-ins)."""
    return {n for n in metric_names(expr) if n not in exported and n not in BUILTIN_SERIES}


# Labels a scrape adds to every series (ServiceMonitor relabelling, the test scrape config).
TARGET_LABELS = frozenset(
    {"namespace", "pod", "component", "job", "instance", "container", "endpoint", "service"}
)


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of `expr` (ValueError as for `metric_names`)."""
    ast = promql_parser.parse(expr)
    out: list[Selector] = []
    problems: list[str] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            matchers = []
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    if m.op != promql_parser.MatchOp.Equal:
                        problems.append(f"{node}: select the metric by its exact name")
                    name = m.value
                else:
                    matchers.append((m.name, str(m.op).rsplit(".", 1)[-1], m.value))
            if not name:
                problems.append(f"{node}: a selector without a metric name")
            else:
                out.append(Selector(name, tuple(matchers)))
        return True

    promql_parser.walk(ast, visit)
    if problems:
        raise ValueError("; ".join(problems))
    return out


def expression_problems(expr: str, families: Iterable[Family]) -> list[str]:
    """What is wrong with `expr` against the inventory: it does not parse, reads a metric no
    component exports, matches on a label the metric does not carry, or asks the trainer for
    a per-step scalar it does not export. Empty when the expression is sound."""
    from relayrl.trainer.metrics import GAUGE_METRICS

    try:
        found = selectors(expr)
    except ValueError as exc:
        return [f"{expr!r} does not parse: {exc}"]
    by_sample = {sample: family for family in families for sample in family.samples}
    problems = []
    for selector in found:
        if selector.name in BUILTIN_SERIES:
            continue
        family = by_sample.get(selector.name)
        if family is None:
            problems.append(f"{selector.name} is not exported by any service or the engine")
            continue
        allowed = set(family.labels) | TARGET_LABELS
        if selector.name.endswith("_bucket"):
            allowed.add("le")
        for label, op, value in selector.matchers:
            if label not in allowed:
                problems.append(f"{selector.name} has no label {label!r}")
            if (
                selector.name == "relayrl_trainer_step_value"
                and label == "metric"
                and op == "Equal"
                and value not in GAUGE_METRICS
            ):
                problems.append(f"the trainer exports no step value metric={value!r}")
    return problems
