"""A real Prometheus scrapes a short `relayrl up` run with the chart's monitoring loaded: the
rendered ServiceMonitors become its scrape config (their relabelings kept, see
prometheus_server.scrape_configs), the rendered PrometheusRule its rule file. Every service is
scraped with its `component` label, every rule evaluates without error, and every core panel
query of the dashboards (deploy/grafana/core-panels.json) returns data."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl_testkit.helpers.prometheus_server import LocalTarget, PrometheusServer, scrape_configs
from relayrl_testkit.helpers.up import (
    SHORT_RUN,
    UpProcess,
    deep_update,
    sharing_cache,
    stack_state,
    wait_for_steps,
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "relayrl"
COMPONENTS = ("gateway", "reward", "trainer", "weightsync", "engine")
STEPS = 200  # never reached: the run trains on while Prometheus gathers, then is stopped
RATE_WINDOW = "10s"  # $__rate_interval for a 1 s scrape interval
MIN_SCRAPES = 5  # per component, within RATE_WINDOW, before the panels are queried


def render_chart(tools: Any) -> list[dict[str, Any]]:
    rendered = subprocess.run(
        [
            str(tools.helm),
            "template",
            "live",
            str(CHART),
            "--namespace",
            "relayrl",
            "-f",
            str(CHART / "ci" / "cpu-demo-values.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def local_targets(objects: list[dict[str, Any]], run_dir: Path) -> list[LocalTarget]:
    """Each component's Services (the ServiceMonitors select among them), every port pointed
    at the run's process for that component."""
    children = stack_state(run_dir).children
    targets = []
    for service in objects:
        labels = service["metadata"].get("labels", {})
        component = labels.get("app.kubernetes.io/component")
        if service["kind"] != "Service" or component not in COMPONENTS:
            continue
        if component == "engine":
            url = str(children["engine-0"].url)
        else:
            url = str(children[component].metrics).removesuffix("/metrics")
        address = url.removeprefix("http://")
        ports = {port["name"]: address for port in service["spec"]["ports"]}
        targets.append(LocalTarget(service, f"{service['metadata']['name']}-0", ports))
    return targets


def wait_for_scrapes(prometheus: PrometheusServer, up: UpProcess, timeout_s: float) -> None:
    """Until every component has MIN_SCRAPES successful scrapes within the last rate window,
    so that every rate() over it has its two samples. Counting steps is not enough: a fast run
    reaches them within seconds of Prometheus' start, and under load a scrape can miss its
    1 s timeout."""
    expr = f"sum by (component) (sum_over_time(up[{RATE_WINDOW}]))"
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {
            s["metric"].get("component"): float(s["value"][1]) for s in prometheus.query(expr)
        }
        if all(counts.get(c, 0) >= MIN_SCRAPES for c in COMPONENTS):
            return
        assert up.process.poll() is None, f"the run ended before enough scrapes: {counts}"
        assert time.monotonic() < deadline, f"too few successful scrapes: {counts}"
        time.sleep(0.5)


def substitute(expr: str, namespace: str) -> str:
    out = expr.replace("$__rate_interval", RATE_WINDOW).replace("$__interval", "1s")
    out = out.replace("${namespace}", namespace).replace("$namespace", namespace)
    out = out.replace("${partition:regex}", ".*").replace("$partition", ".*")
    if "$" in out:
        raise AssertionError(f"a Grafana variable this test cannot fill: {expr}")
    return out


@pytest.mark.timeout(900)
def test_prometheus_scrapes_a_run_with_the_charts_monitoring_and_panels_have_data(
    deploy_tools: Any, tmp_path: Path, up_cache: Path
) -> None:
    objects = render_chart(deploy_tools)
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    alert_names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    core = json.loads((REPO / "deploy/grafana/core-panels.json").read_text())["panels"]

    config = deep_update(SHORT_RUN, {"train": {"steps": STEPS}, "eval": {"interval_steps": 0}})
    runs_dir = sharing_cache(tmp_path / "runs", up_cache)
    up = UpProcess.start(runs_dir, config, "--mode", "separate_async")
    prometheus = PrometheusServer(deploy_tools.prometheus, tmp_path / "prometheus")
    try:
        wait_for_steps(up, 1, 600)
        targets = local_targets(objects, up.run_dir)
        prometheus.start(scrape_configs(monitors, targets, "1s"), [rules_path])
        wait_for_steps(up, 6, 600)
        wait_for_scrapes(prometheus, up, 300)
        at = time.time()  # queried at this moment, while the run was still training
        assert up.process.poll() is None, "the run ended before Prometheus saw enough of it"

        up_series = prometheus.query("up", at)
        seen = {s["metric"].get("component"): s["value"][1] for s in up_series}
        assert seen == {c: "1" for c in COMPONENTS}, (seen, prometheus.log())
        assert {s["metric"]["namespace"] for s in up_series} == {"relayrl"}

        groups = prometheus.api("rules")["groups"]
        evaluated = {r["name"]: r for g in groups for r in g["rules"]}
        assert alert_names <= set(evaluated), alert_names - set(evaluated)
        broken = {n: r.get("lastError") for n, r in evaluated.items() if r["health"] != "ok"}
        assert not broken, broken
        alerts = prometheus.api("alerts")["alerts"]
        firing = [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"]
        assert not firing, f"alerts firing on a healthy run: {firing}"

        empty = []
        for panel in core:
            expr = substitute(panel["expr"], "relayrl")
            if not prometheus.query(expr, at):
                empty.append(f"{panel['dashboard']} / {panel['panel']}: {expr}")
        assert not empty, "core panel queries without data:\n" + "\n".join(empty)
        # What Prometheus had to see, it saw: the rest of the run would only train on. It
        # stops as a user stops it, cleanly (the e2e tests train runs to their end).
        up.interrupt()
        assert up.wait(300) == 130, up.output()
    finally:
        prometheus.stop()
        up.stop()
