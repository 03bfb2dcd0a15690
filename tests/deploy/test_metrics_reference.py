"""deploy/docs/metrics.md cannot rot: it documents exactly the metrics the services register
(with their type and labels), every per-step trainer value they export, and every vLLM metric
the dashboards use, each of which a real vLLM engine exports."""

from __future__ import annotations

import json
import re

import pytest

from relayrl_testkit import REPO
from relayrl_testkit.helpers.engines import SharedEngine
from relayrl_testkit.helpers.metric_inventory import (
    ENGINE,
    SERVICES,
    Family,
    families_from_text,
    metric_names,
    scrape_engine_metrics,
    service_families,
)

METRICS_MD = REPO / "deploy" / "docs" / "metrics.md"
DASHBOARDS = REPO / "deploy" / "grafana" / "dashboards"
_ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<type>\w+) \| (?P<labels>[^|]*) \|", re.MULTILINE)


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Metric name -> (type, labels) from the reference's tables."""
    out = {}
    for match in _ROW.finditer(METRICS_MD.read_text(encoding="utf-8")):
        labels = tuple(re.findall(r"`([^`]+)`", match.group("labels")))
        assert match.group("name") not in out, f"{match.group('name')} documented twice"
        out[match.group("name")] = (match.group("type"), labels)
    return out


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> list[Family]:
    return service_families(tmp_path_factory.mktemp("inventory"))


@pytest.fixture(scope="module")
def engine_families(shared_engine: SharedEngine) -> list[Family]:
    """A real vLLM engine's families (the session's engine; scraping changes nothing in it)."""
    return families_from_text(ENGINE, scrape_engine_metrics(shared_engine.lease().url))


def test_every_service_metric_is_documented_and_nothing_else(services: list[Family]) -> None:
    exported = {f.query_name: f for f in services}
    assert {f.component for f in services} == set(SERVICES)
    docs = {n: v for n, v in documented().items() if n.startswith("relayrl_")}
    assert not set(exported) - set(docs), f"undocumented: {sorted(set(exported) - set(docs))}"
    assert not set(docs) - set(exported), f"not exported: {sorted(set(docs) - set(exported))}"
    for name, (type_, labels) in docs.items():
        family = exported[name]
        assert type_ == family.type, f"{name}: documented {type_}, is {family.type}"
        assert set(labels) == set(family.labels), f"{name}: labels {labels} vs {family.labels}"


def test_every_per_step_trainer_value_is_documented() -> None:
    from relayrl.trainer.metrics import GAUGE_METRICS

    text = METRICS_MD.read_text(encoding="utf-8")
    section = text.split("relayrl_trainer_step_value{metric=...}", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    assert rows == set(GAUGE_METRICS)


def test_documented_vllm_metrics_exist_and_cover_the_dashboards(
    engine_families: list[Family],
) -> None:
    exported = {f.query_name: f for f in engine_families}
    docs = {n: v for n, v in documented().items() if n.startswith("vllm:")}
    for name, (type_, labels) in docs.items():
        assert name in exported, f"{name} is documented but the engine does not export it"
        assert type_ == exported[name].type, name
        assert set(labels) <= set(exported[name].labels), name
    used = set()
    for path in DASHBOARDS.glob("*.json"):
        for expr in re.findall(r'"expr": ("(?:[^"\\]|\\.)*")', path.read_text(encoding="utf-8")):
            expr = json.loads(expr)
            expr = re.sub(r"\$\{?\w+(:\w+)?\}?", "1m", expr)  # variables do not name metrics
            used |= {n for n in metric_names(expr) if n.startswith("vllm:")}
    bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert used, "the dashboards use no vLLM metric"
    assert not bases - set(docs), f"used by dashboards, undocumented: {sorted(bases - set(docs))}"
