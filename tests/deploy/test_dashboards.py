"""The Grafana dashboards in deploy/grafana/dashboards: each loads, has the structure Grafana
and the chart rely on (uid, datasource variable used by every panel), is current with its
generator, and every query parses and reads only metrics and labels a service or the vLLM
engine really exports (relayrl services from their registries, vLLM from a real engine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

from relayrl_testkit import REPO
from relayrl_testkit.helpers.engines import SharedEngine
from relayrl_testkit.helpers.metric_inventory import (
    ENGINE,
    Family,
    expression_problems,
    families_from_text,
    metric_names,
    scrape_engine_metrics,
    service_families,
    substitute_grafana_variables,
)

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
NAMES = ("overview", "rollout", "reward", "trainer", "weightsync")
DATASOURCE = "${datasource}"


def load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / f"relayrl-{name}.json").read_text(encoding="utf-8"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def variable_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """A concrete value for each of the dashboard's own variables."""
    return {v["name"]: "relayrl" for v in dashboard["templating"]["list"]}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL with variables substituted) for every panel target and query variable."""
    values = variable_values(dashboard)
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            where = f"{dashboard['uid']} / {panel['title']} / {target['refId']}"
            out.append((where, substitute_grafana_variables(target["expr"], values)))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert match, f"{dashboard['uid']} ${variable['name']}: not a label_values() query"
        where = f"{dashboard['uid']} ${variable['name']}"
        out.append((where, substitute_grafana_variables(match.group(1), values)))
    return out


@pytest.fixture(scope="module")
def families(shared_engine: SharedEngine, tmp_path_factory: pytest.TempPathFactory) -> list[Family]:
    """The four services' families and a real vLLM engine's (the session's)."""
    engine_text = scrape_engine_metrics(shared_engine.lease().url)
    return [
        *service_families(tmp_path_factory.mktemp("inventory")),
        *families_from_text(ENGINE, engine_text),
    ]


def test_dashboards_are_current_with_their_generator() -> None:
    result = subprocess.run(
        [sys.executable, GRAFANA / "generate_dashboards.py", "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", NAMES)
def test_dashboard_structure(name: str) -> None:
    dashboard = load(name)
    assert dashboard["uid"] == f"relayrl-{name}"
    assert dashboard["title"].strip()
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "namespace" in variables
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == DATASOURCE, variable["name"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    drawn = [p for p in panels(dashboard) if p["type"] != "row"]
    assert drawn
    for panel in drawn:
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, title
        assert panel["targets"], f"{title}: no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DATASOURCE, title
            assert target["expr"].strip(), title
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, title
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        assert panel.get("description", "").strip(), f"{title}: no description"


@pytest.mark.parametrize("name", NAMES)
def test_every_query_parses_and_reads_exported_metrics(name: str, families: list[Family]) -> None:
    problems = []
    for where, expr in queries(load(name)):
        problems += [f"{where}: {p}" for p in expression_problems(expr, families)]
    assert not problems, "\n".join(problems)


def test_the_rollout_dashboard_shows_the_vllm_engines(families: list[Family]) -> None:
    used = {n for _, expr in queries(load("rollout")) for n in metric_names(expr)}
    vllm = {n for n in used if n.startswith("vllm:")}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= vllm
    assert "vllm:kv_cache_usage_perc" in vllm


def test_core_panels_are_real_panels_with_their_queries() -> None:
    core = json.loads((GRAFANA / "core-panels.json").read_text(encoding="utf-8"))["panels"]
    targets = {
        (load(name)["uid"], panel["title"], target["expr"])
        for name in NAMES
        for panel in panels(load(name))
        for target in panel.get("targets", [])
    }
    for entry in core:
        key = (entry["dashboard"], entry["panel"], entry["expr"])
        assert key in targets, f"core panel not in its dashboard: {key}"
    assert {e["dashboard"] for e in core} == {f"relayrl-{n}" for n in NAMES}
    for entry in core:  # only series every short run has; error-only series are never core
        assert not re.search(r'outcome="failed"|status=~"INFRA|failures_total', entry["expr"])
        # a live run fills only the run's namespace, its partitions and Grafana's intervals
        substitute_grafana_variables(entry["expr"], {"namespace": "rl", "partition": "train"})
        assert "$__range" not in entry["expr"], entry["panel"]


# --- the checks catch what they claim to catch ------------------------------------------------


def test_a_made_up_metric_is_reported(families: list[Family]) -> None:
    problems = expression_problems(
        'sum(rate(relayrl_gateway_rollouts_made_up_total{namespace="rl"}[5m]))', families
    )
    assert any("relayrl_gateway_rollouts_made_up_total" in p for p in problems)
    assert expression_problems('sum(rate(vllm:no_such_metric_total{namespace="rl"}[5m]))', families)
    assert not expression_problems(
        'sum(rate(relayrl_gateway_rollouts_total{namespace="rl"}[5m]))', families
    )


def test_a_label_the_metric_lacks_is_reported(families: list[Family]) -> None:
    problems = expression_problems('relayrl_gateway_rollouts_total{outcom="failed"}', families)
    assert problems and "outcom" in problems[0]
    problems = expression_problems('relayrl_trainer_step_value{metric="no_such"}', families)
    assert problems and "no_such" in problems[0]


def test_a_broken_expression_is_reported(families: list[Family]) -> None:
    problems = expression_problems("sum(rate(relayrl_gateway_rollouts_total[5m])", families)
    assert problems and "does not parse" in problems[0]
    assert expression_problems('{__name__=~"relayrl_.+"}', families)


def test_an_undefined_grafana_variable_is_reported() -> None:
    values = {"namespace": "rl"}
    expr = 'rate(x{namespace="$namespace", partition=~"${partition:regex}"}[$__rate_interval])'
    with pytest.raises(KeyError, match="partition"):
        substitute_grafana_variables(expr, values)
    assert substitute_grafana_variables(expr, values | {"partition": "train"}) == (
        'rate(x{namespace="rl", partition=~"train"}[1m])'
    )
