"""Writes relayrl's Grafana dashboards (dashboards/relayrl-*.json) and the list of core panels
(core-panels.json) from one description, so that every dashboard shares the same datasource
and namespace variables, units and layout rules.

    .venv/bin/python deploy/grafana/generate_dashboards.py          # rewrite the files
    .venv/bin/python deploy/grafana/generate_dashboards.py --check  # exit 1 if they are stale

The JSON files are what ships (the Helm chart mounts them as ConfigMaps); edit this script and
regenerate rather than editing the JSON by hand. tests/deploy/test_dashboards.py checks that
the files are current and that every query parses and reads metrics a service really exports.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DASHBOARDS = HERE / "dashboards"
CORE_PANELS = HERE / "core-panels.json"

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace="$namespace"'
RATE = "$__rate_interval"


# --- building blocks ------------------------------------------------------------------------


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    # in a core panel: a series that only appears after something went wrong (a redelivery, an
    # error) is not expected to have data in a short healthy run
    only_on_trouble: bool = False


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    kind: str = "timeseries"  # timeseries | stat | gauge | bargauge
    unit: str = "short"
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    thresholds: list[tuple[float | None, str]] = field(default_factory=lambda: [(None, "green")])
    stacked: bool = False
    core: bool = False  # its series exist in any short end-to-end run (core-panels.json)


@dataclass
class Row:
    title: str
    panels: list[Panel]


@dataclass
class Variable:
    name: str
    label: str
    query: str  # label_values(...)
    multi: bool = False


@dataclass
class Dashboard:
    name: str
    title: str
    description: str
    tags: list[str]
    rows: list[Row]
    variables: list[Variable] = field(default_factory=list)


def quantile(q: float, bucket: str, selector: str, by: str = "") -> str:
    group = f"{by}, le" if by else "le"
    return (
        f"histogram_quantile({q}, sum by ({group}) (rate({bucket}_bucket{{{selector}}}[{RATE}])))"
    )


def step_value(metric: str) -> str:
    return f'relayrl_trainer_step_value{{{NS}, metric="{metric}"}}'


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    refs = "ABCDEFGHIJ"
    targets = []
    for i, t in enumerate(panel.targets):
        target: dict[str, Any] = {
            "datasource": DS,
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "refId": refs[i],
            "range": not t.instant,
            "instant": t.instant,
        }
        targets.append(target)
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for value, color in panel.thresholds],
        },
        "color": {"mode": "palette-classic" if panel.kind == "timeseries" else "thresholds"},
    }
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    options: dict[str, Any]
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if panel.stacked else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if len(panel.thresholds) > 1 else "off"},
        }
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "auto",
        }
        if panel.kind == "stat":
            options.update(colorMode="value", graphMode="area", textMode="auto")
        if panel.kind == "bargauge":
            options.update(displayMode="gradient", showUnfilled=True)
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": targets,
    }


def _variables_json(dashboard: Dashboard) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "options": [],
        }
    ]
    variables = [
        Variable(
            "namespace",
            "Namespace",
            'label_values(up{component=~"gateway|reward|trainer|weightsync|engine"}, namespace)',
        ),
        *dashboard.variables,
    ]
    for v in variables:
        out.append(
            {
                "name": v.name,
                "label": v.label,
                "type": "query",
                "datasource": DS,
                "definition": v.query,
                "query": {"query": v.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "current": {},
                "hide": 0,
                "refresh": 2,  # on time-range change: new partitions and replicas show up
                "sort": 1,
                "multi": v.multi,
                "includeAll": v.multi,
                "regex": "",
                "options": [],
            }
        )
    return out


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    panel_id, y = 1, 0
    for row in dashboard.rows:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y = panel_id + 1, y + 1
        x, row_height = 0, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, row_height = 0, y + row_height, 0
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return {
        "uid": f"relayrl-{dashboard.name}",
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["relayrl", *dashboard.tags],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [
            {
                "title": "relayrl dashboards",
                "type": "dashboards",
                "tags": ["relayrl"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": _variables_json(dashboard)},
        "panels": panels,
    }


# --- the dashboards -------------------------------------------------------------------------

GREEN = (None, "green")


def overview() -> Dashboard:
    return Dashboard(
        "overview",
        "relayrl / Overview",
        "One run at a glance: service health, training progress, rollout, reward and weight "
        "sync. Each row links to its service's dashboard.",
        ["overview"],
        [
            Row(
                "Health",
                [
                    Panel(
                        "Targets up by component",
                        "Scrape targets answering, per component (gateway, reward, trainer, "
                        "weightsync, engine). A drop means a pod is down or restarting.",
                        [Target(f"sum by (component) (up{{{NS}}})", "{{component}}", instant=True)],
                        kind="stat",
                        width=8,
                        height=5,
                        thresholds=[(None, "red"), (1, "green")],
                    ),
                    Panel(
                        "Firing relayrl alerts",
                        "Alerts of deploy/prometheus/rules in state firing; see "
                        "deploy/docs/operations.md for each one's runbook.",
                        [
                            Target(
                                f'count(ALERTS{{alertstate="firing", alertname=~"Relayrl.+", '
                                f"{NS}}}) or vector(0)",
                                "firing",
                                instant=True,
                            )
                        ],
                        kind="stat",
                        width=4,
                        height=5,
                        thresholds=[GREEN, (1, "red")],
                    ),
                    Panel(
                        "TransferQueue reachable",
                        "1 when the trainer could read the TransferQueue (Redis) at its last "
                        "scrape.",
                        [Target(f"max(relayrl_trainer_tq_up_bool{{{NS}}})", "tq", instant=True)],
                        kind="stat",
                        width=4,
                        height=5,
                        thresholds=[(None, "red"), (1, "green")],
                    ),
                    Panel(
                        "Trainer step",
                        "Steps the trainer has completed.",
                        [
                            Target(
                                f"max(relayrl_trainer_completed_steps{{{NS}}})",
                                "step",
                                instant=True,
                            )
                        ],
                        kind="stat",
                        width=4,
                        height=5,
                        core=True,
                    ),
                    Panel(
                        "Committed weight version",
                        "The weight version committed on every live engine replica.",
                        [
                            Target(
                                f"max(relayrl_weightsync_committed_version{{{NS}}})",
                                "committed",
                                instant=True,
                            )
                        ],
                        kind="stat",
                        width=4,
                        height=5,
                    ),
                ],
            ),
            Row(
                "Training",
                [
                    Panel(
                        "Reward mean",
                        "Mean reward of the valid (non-infra) trajectories trained at each step.",
                        [Target(step_value("reward_mean"), "reward mean")],
                        core=True,
                    ),
                    Panel(
                        "Trained staleness p50 / p99 vs bound",
                        "Staleness (step - prompt_step + 1) of trained groups. p99 above the "
                        "bound fires RelayrlStalenessP99AboveBound.",
                        [
                            Target(
                                quantile(0.5, "relayrl_trainer_trained_staleness_steps", NS), "p50"
                            ),
                            Target(
                                quantile(0.99, "relayrl_trainer_trained_staleness_steps", NS), "p99"
                            ),
                            Target(f"max(relayrl_trainer_staleness_bound_steps{{{NS}}})", "bound"),
                        ],
                        unit="none",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Train/inference mismatch |log π_old - log μ|",
                        "Per-token absolute log-ratio between the trainer's recomputed "
                        "log-probs and the engine's. p99 above 0.5 fires "
                        "RelayrlTrainInferenceMismatchHigh.",
                        [
                            Target(step_value("abs_log_ratio_mean"), "mean"),
                            Target(step_value("abs_log_ratio_p99"), "p99"),
                        ],
                        unit="none",
                        min=0,
                        thresholds=[GREEN, (0.5, "red")],
                    ),
                ],
            ),
            Row(
                "Rollout, reward, weight sync",
                [
                    Panel(
                        "Rollouts / s by outcome",
                        "Trajectories the gateways write, finished or failed (is_infra).",
                        [
                            Target(
                                f"sum by (outcome) (rate(relayrl_gateway_rollouts_total{{{NS}}}"
                                f"[{RATE}]))",
                                "{{outcome}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Reward backlog vs capacity",
                        "Items accepted by the reward-service and not finished, and the "
                        "configured bound.",
                        [
                            Target(f"sum(relayrl_reward_backlog_items{{{NS}}})", "backlog"),
                            Target(
                                f"sum(relayrl_reward_backlog_capacity_items{{{NS}}})", "capacity"
                            ),
                        ],
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Weight update pause p90",
                        "How long rollout stays paused per weight update (pause_window).",
                        [
                            Target(
                                quantile(
                                    0.9,
                                    "relayrl_weightsync_boundary_duration_seconds",
                                    f'{NS}, boundary="pause_window"',
                                ),
                                "p90",
                            )
                        ],
                        unit="s",
                        min=0,
                        thresholds=[GREEN, (60, "red")],
                    ),
                ],
            ),
        ],
    )


def rollout() -> Dashboard:
    part = f'{NS}, partition=~"${{partition:regex}}"'
    rep = NS  # every replica: a short list, and one legend entry each
    return Dashboard(
        "rollout",
        "relayrl / Rollout",
        "The rollout-gateway (throttle, rollouts, engine routing) and the vLLM engine replicas.",
        ["rollout", "gateway", "vllm"],
        [
            Row(
                "Rollouts and the staleness throttle",
                [
                    Panel(
                        "Rollouts / s by partition and outcome",
                        "Trajectories written to the TransferQueue; failed = is_infra.",
                        [
                            Target(
                                f"sum by (partition, outcome) (rate(relayrl_gateway_rollouts_total"
                                f"{{{part}}}[{RATE}]))",
                                "{{partition}} {{outcome}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Infra failure ratio",
                        "Share of trajectories that failed on infrastructure; above 10% for "
                        "15 min fires RelayrlRolloutInfraFailureRateHigh.",
                        [
                            Target(
                                "sum by (partition) (rate(relayrl_gateway_rollouts_total"
                                f'{{{part}, outcome="failed"}}[{RATE}])) / sum by (partition) '
                                f"(rate(relayrl_gateway_rollouts_total{{{part}}}[{RATE}]))",
                                "{{partition}}",
                            )
                        ],
                        unit="percentunit",
                        min=0,
                        max=1,
                        thresholds=[GREEN, (0.1, "red")],
                    ),
                    Panel(
                        "Launched groups vs throttle cap",
                        "Groups claimed and not returned, against (v + 1 + η)·B: rollout "
                        "starts only while launched < cap.",
                        [
                            Target(
                                "max by (partition) (relayrl_gateway_groups_launched_groups"
                                f"{{{part}}})",
                                "{{partition}} launched",
                            ),
                            Target(
                                "max by (partition) (relayrl_gateway_throttle_max_launched_groups"
                                f"{{{part}}})",
                                "{{partition}} cap",
                            ),
                        ],
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Groups in flight per gateway",
                        "Groups each gateway pod is rolling out now.",
                        [
                            Target(
                                f"sum by (pod) (relayrl_gateway_groups_inflight_groups{{{part}}})",
                                "{{pod}}",
                            )
                        ],
                        min=0,
                    ),
                    Panel(
                        "Launch staleness p50 / p99",
                        "Trainer step at launch minus the group's prompt step.",
                        [
                            Target(
                                quantile(0.5, "relayrl_gateway_launch_staleness_steps", part),
                                "p50",
                            ),
                            Target(
                                quantile(0.99, "relayrl_gateway_launch_staleness_steps", part),
                                "p99",
                            ),
                        ],
                        unit="none",
                        min=0,
                    ),
                    Panel(
                        "Groups requeued / s (expired leases)",
                        "Groups whose claimer stopped renewing its lease (a gateway died), "
                        "returned to pending.",
                        [
                            Target(
                                "sum by (partition) (rate(relayrl_gateway_groups_requeued_total"
                                f"{{{part}}}[{RATE}]))",
                                "{{partition}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                    ),
                ],
            ),
            Row(
                "Engine routing (gateway view)",
                [
                    Panel(
                        "Replicas serving",
                        "1 while a replica is in routing; 0 while paused, loading, drained or "
                        "unhealthy.",
                        [
                            Target(
                                f"max by (replica) (relayrl_gateway_replica_serving_bool{{{rep}}})",
                                "{{replica}}",
                            )
                        ],
                        min=0,
                        max=1,
                        thresholds=[(None, "red"), (1, "green")],
                    ),
                    Panel(
                        "Generate calls / s by replica and outcome",
                        "Calls the gateway sends to each engine replica: ok, aborted (weight "
                        "update), error.",
                        [
                            Target(
                                "sum by (replica, outcome) (rate("
                                f"relayrl_gateway_engine_requests_total{{{rep}}}[{RATE}]))",
                                "{{replica}} {{outcome}}",
                            )
                        ],
                        unit="reqps",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Generate call duration p50 / p99",
                        "Duration of one generate call, by replica.",
                        [
                            Target(
                                quantile(
                                    0.5,
                                    "relayrl_gateway_engine_request_duration_seconds",
                                    rep,
                                    "replica",
                                ),
                                "{{replica}} p50",
                            ),
                            Target(
                                quantile(
                                    0.99,
                                    "relayrl_gateway_engine_request_duration_seconds",
                                    rep,
                                    "replica",
                                ),
                                "{{replica}} p99",
                            ),
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "Rollout duration p50 / p99 (whole trajectory)",
                        "One rollout from claim to written trajectory: every turn, tool call "
                        "and pause. The straggler tail a synchronous step waits for; "
                        "`relayrl sim --durations-from-prometheus` plans capacity from it.",
                        [
                            Target(
                                quantile(0.5, "relayrl_gateway_rollout_duration_seconds", NS),
                                "p50",
                            ),
                            Target(
                                quantile(0.99, "relayrl_gateway_rollout_duration_seconds", NS),
                                "p99",
                            ),
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "Generated tokens / s by replica",
                        "Tokens returned to the gateway by each replica.",
                        [
                            Target(
                                "sum by (replica) (rate("
                                f"relayrl_gateway_engine_generated_tokens_total{{{rep}}}[{RATE}]))",
                                "{{replica}}",
                            )
                        ],
                        unit="short",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Calls in flight by replica",
                        "The gateway's routing queue depth per replica.",
                        [
                            Target(
                                "sum by (replica) (relayrl_gateway_engine_inflight_requests"
                                f"{{{rep}}})",
                                "{{replica}}",
                            )
                        ],
                        min=0,
                    ),
                    Panel(
                        "Open sticky sessions",
                        "Trajectories and agent sessions pinned to a replica.",
                        [
                            Target(
                                f"sum by (pod) (relayrl_gateway_sticky_sessions{{{NS}}})",
                                "{{pod}}",
                            )
                        ],
                        min=0,
                    ),
                    Panel(
                        "Pause for weight update p90",
                        "Time replicas spend paused per weight update (pause to resume), as "
                        "the gateway sees it.",
                        [
                            Target(
                                quantile(0.9, "relayrl_gateway_pause_duration_seconds", NS), "p90"
                            )
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "Prefix-cache resets / s",
                        "One per replica per weight update.",
                        [
                            Target(
                                "sum by (replica) (rate("
                                f"relayrl_gateway_prefix_cache_resets_total{{{rep}}}[{RATE}]))",
                                "{{replica}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                    ),
                ],
            ),
            Row(
                "vLLM engines",
                [
                    Panel(
                        "Requests running / waiting",
                        "vLLM's scheduler: sequences decoding now and queued.",
                        [
                            Target(
                                f"sum by (pod) (vllm:num_requests_running{{{NS}}})",
                                "{{pod}} running",
                            ),
                            Target(
                                f"sum by (pod) (vllm:num_requests_waiting{{{NS}}})",
                                "{{pod}} waiting",
                            ),
                        ],
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "KV cache usage",
                        "Share of the KV cache in use per engine; near 100% means preemptions.",
                        [Target(f"max by (pod) (vllm:kv_cache_usage_perc{{{NS}}})", "{{pod}}")],
                        unit="percentunit",
                        min=0,
                        max=1,
                        thresholds=[GREEN, (0.9, "orange")],
                        core=True,
                    ),
                    Panel(
                        "Engine tokens / s (prompt, generation)",
                        "Prompt tokens prefilled and tokens generated per second.",
                        [
                            Target(
                                f"sum by (pod) (rate(vllm:prompt_tokens_total{{{NS}}}[{RATE}]))",
                                "{{pod}} prompt",
                            ),
                            Target(
                                "sum by (pod) (rate(vllm:generation_tokens_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{pod}} generation",
                            ),
                        ],
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Time to first token p50 / p99",
                        "From vLLM's request histogram.",
                        [
                            Target(quantile(0.5, "vllm:time_to_first_token_seconds", NS), "p50"),
                            Target(quantile(0.99, "vllm:time_to_first_token_seconds", NS), "p99"),
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "Prefix cache hit ratio",
                        "Prompt tokens served from the prefix cache (sticky sessions should "
                        "keep this high for multi-turn agents).",
                        [
                            Target(
                                f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{NS}}}[{RATE}]))"
                                " / sum by (pod) (rate(vllm:prefix_cache_queries_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{pod}}",
                            )
                        ],
                        unit="percentunit",
                        min=0,
                        max=1,
                    ),
                    Panel(
                        "Preemptions / s",
                        "Sequences preempted for lack of KV cache.",
                        [
                            Target(
                                f"sum by (pod) (rate(vllm:num_preemptions_total{{{NS}}}[{RATE}]))",
                                "{{pod}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                    ),
                ],
            ),
        ],
        [
            Variable(
                "partition",
                "Partition",
                f"label_values(relayrl_gateway_groups_launched_groups{{{NS}}}, partition)",
                multi=True,
            ),
        ],
    )


def reward() -> Dashboard:
    mgr = NS  # every configured manager, one legend entry each
    return Dashboard(
        "reward",
        "relayrl / Reward",
        "The reward-service: submissions, backlog and back-pressure, micro-batched backend "
        "calls, results by status, tenants and the TransferQueue scorer.",
        ["reward"],
        [
            Row(
                "Intake and backlog",
                [
                    Panel(
                        "Submissions / s by API",
                        "Score/Submit calls, streamed items, TransferQueue batches.",
                        [
                            Target(
                                "sum by (api) (rate(relayrl_reward_submissions_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{api}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                    ),
                    Panel(
                        "Items accepted / s by manager",
                        "Items entering the backlog.",
                        [
                            Target(
                                "sum by (manager) (rate(relayrl_reward_items_submitted_total"
                                f"{{{mgr}}}[{RATE}]))",
                                "{{manager}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Backlog vs capacity",
                        "Items accepted and not finished, the largest backlog seen, and the "
                        "configured bound, per pod.",
                        [
                            Target(
                                f"sum by (pod) (relayrl_reward_backlog_items{{{NS}}})",
                                "{{pod}} backlog",
                            ),
                            Target(
                                f"max by (pod) (relayrl_reward_backlog_max_items{{{NS}}})",
                                "{{pod}} max seen",
                            ),
                            Target(
                                f"max by (pod) (relayrl_reward_backlog_capacity_items{{{NS}}})",
                                "{{pod}} capacity",
                            ),
                        ],
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Backlog fill",
                        "Backlog over capacity; above 90% for 10 min fires "
                        "RelayrlRewardBacklogSaturated.",
                        [
                            Target(
                                f"max by (pod) (relayrl_reward_backlog_items{{{NS}}} / "
                                f"(relayrl_reward_backlog_capacity_items{{{NS}}} > 0))",
                                "{{pod}}",
                            )
                        ],
                        kind="gauge",
                        unit="percentunit",
                        min=0,
                        max=1,
                        thresholds=[GREEN, (0.75, "orange"), (0.9, "red")],
                    ),
                    Panel(
                        "Evicted / quota-rejected / s",
                        "Items evicted by drop_oldest back-pressure (returned RATE_LIMITED) "
                        "and requests refused by tenant quotas.",
                        [
                            Target(
                                "sum by (manager) (rate(relayrl_reward_items_evicted_total"
                                f"{{{mgr}}}[{RATE}]))",
                                "evicted {{manager}}",
                            ),
                            Target(
                                "sum by (tenant, quota) (rate("
                                f"relayrl_reward_quota_rejections_total{{{NS}}}[{RATE}]))",
                                "quota {{tenant}} {{quota}}",
                            ),
                        ],
                        unit="ops",
                        min=0,
                    ),
                    Panel(
                        "Overlap ratio",
                        "1 - collect_wait / (submit + reward): the share of reward work "
                        "hidden behind the caller's other work.",
                        [Target(f"max by (pod) (relayrl_reward_overlap_ratio{{{NS}}})", "{{pod}}")],
                        unit="percentunit",
                        min=0,
                        max=1,
                    ),
                ],
            ),
            Row(
                "Backends and results",
                [
                    Panel(
                        "Results / s by status",
                        "Item results: OK, POLICY_FAIL, INFRA_ERROR, TIMEOUT, RATE_LIMITED, "
                        "INVALID_INPUT.",
                        [
                            Target(
                                "sum by (status) (rate(relayrl_reward_results_total"
                                f"{{{mgr}}}[{RATE}]))",
                                "{{status}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        stacked=True,
                        core=True,
                    ),
                    Panel(
                        "Error ratio (INFRA_ERROR, TIMEOUT) by manager",
                        "Above 5% for 10 min fires RelayrlRewardErrorRateHigh.",
                        [
                            Target(
                                "sum by (manager) (rate(relayrl_reward_results_total"
                                f'{{{mgr}, status=~"INFRA_ERROR|TIMEOUT"}}[{RATE}])) / '
                                "sum by (manager) (rate(relayrl_reward_results_total"
                                f"{{{mgr}}}[{RATE}]))",
                                "{{manager}}",
                            )
                        ],
                        unit="percentunit",
                        min=0,
                        thresholds=[GREEN, (0.05, "red")],
                    ),
                    Panel(
                        "Item latency p50 / p99",
                        "From an item's acceptance to its result.",
                        [
                            Target(
                                quantile(
                                    0.5, "relayrl_reward_item_latency_seconds", mgr, "manager"
                                ),
                                "{{manager}} p50",
                            ),
                            Target(
                                quantile(
                                    0.99, "relayrl_reward_item_latency_seconds", mgr, "manager"
                                ),
                                "{{manager}} p99",
                            ),
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "Backend calls / s by manager",
                        "Calls to a manager's backend (one micro-batch or chunk each).",
                        [
                            Target(
                                "sum by (manager) (rate(relayrl_reward_backend_requests_total"
                                f"{{{mgr}}}[{RATE}]))",
                                "{{manager}}",
                            )
                        ],
                        unit="reqps",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Items per backend call",
                        "Average micro-batch size: micro-batching works when this is well above 1.",
                        [
                            Target(
                                "sum by (manager) (rate(relayrl_reward_backend_request_items_sum"
                                f"{{{mgr}}}[{RATE}])) / sum by (manager) (rate("
                                f"relayrl_reward_backend_request_items_count{{{mgr}}}[{RATE}]))",
                                "{{manager}}",
                            )
                        ],
                        min=0,
                    ),
                    Panel(
                        "Backend call duration p99 / in flight",
                        "Duration of one backend call, and calls running now.",
                        [
                            Target(
                                quantile(
                                    0.99,
                                    "relayrl_reward_backend_request_duration_seconds",
                                    mgr,
                                    "manager",
                                ),
                                "{{manager}} p99 (s)",
                            ),
                            Target(
                                "sum by (manager) (relayrl_reward_backend_inflight_calls"
                                f"{{{mgr}}})",
                                "{{manager}} in flight",
                            ),
                        ],
                        min=0,
                    ),
                ],
            ),
            Row(
                "Callers and the TransferQueue scorer",
                [
                    Panel(
                        "Collect wait p50 / p99 and submit p99",
                        "The reward tail a caller sees, and the time a submission took to "
                        "enter the backlog (back-pressure waits included).",
                        [
                            Target(
                                quantile(0.5, "relayrl_reward_collect_wait_seconds", NS),
                                "collect p50",
                            ),
                            Target(
                                quantile(0.99, "relayrl_reward_collect_wait_seconds", NS),
                                "collect p99",
                            ),
                            Target(
                                quantile(0.99, "relayrl_reward_submit_duration_seconds", NS),
                                "submit p99",
                            ),
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "Collects / s by completeness",
                        "Collect calls, by whether the handle was complete.",
                        [
                            Target(
                                "sum by (done) (rate(relayrl_reward_collects_total"
                                f"{{{NS}}}[{RATE}]))",
                                "done={{done}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                    ),
                    Panel(
                        "TransferQueue trajectories scored / s",
                        "Trajectories this service scored from the TransferQueue stream, by "
                        "status, and events delivered more than once.",
                        [
                            Target(
                                "sum by (partition, status) (rate("
                                f"relayrl_reward_tq_trajectories_scored_total{{{NS}}}[{RATE}]))",
                                "{{partition}} {{status}}",
                            ),
                            Target(
                                "sum by (partition) (rate(relayrl_reward_tq_redeliveries_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{partition}} redelivered",
                                only_on_trouble=True,
                            ),
                        ],
                        unit="ops",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "gRPC calls / s by method and code",
                        "Calls the reward-service handled (other teams call it directly).",
                        [
                            Target(
                                "sum by (method, code) (rate(relayrl_reward_grpc_requests_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{method}} {{code}}",
                            )
                        ],
                        unit="reqps",
                        min=0,
                        width=16,
                    ),
                    Panel(
                        "gRPC latency p99 by method",
                        "Handler start to end (streams: the whole stream).",
                        [
                            Target(
                                quantile(
                                    0.99,
                                    "relayrl_reward_grpc_request_duration_seconds",
                                    NS,
                                    "method",
                                ),
                                "{{method}}",
                            )
                        ],
                        unit="s",
                        min=0,
                    ),
                ],
            ),
        ],
    )


def trainer() -> Dashboard:
    tq = f'{NS}, partition=~"${{partition:regex}}"'
    return Dashboard(
        "trainer",
        "relayrl / Trainer",
        "Per-step training metrics (the same record as the trainer's JSONL log), off-policy "
        "health (staleness, train/inference mismatch, importance weights) and the "
        "TransferQueue as the trainer reads it.",
        ["trainer"],
        [
            Row(
                "Progress",
                [
                    Panel(
                        "Completed steps / published version",
                        "Steps completed and the policy version last published to rollout.",
                        [
                            Target(f"max(relayrl_trainer_completed_steps{{{NS}}})", "step"),
                            Target(
                                f"max(relayrl_trainer_published_policy_version{{{NS}}})",
                                "published version",
                            ),
                        ],
                        unit="none",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Step duration by phase",
                        "Duration of each phase of the last step (wait for data, old "
                        "log-probs, update, publish).",
                        [
                            Target(
                                f"max by (phase) (relayrl_trainer_phase_duration_seconds{{{NS}}})",
                                "{{phase}}",
                            )
                        ],
                        unit="s",
                        min=0,
                        stacked=True,
                        core=True,
                    ),
                    Panel(
                        "Trained tokens / s",
                        "Trained tokens (prompt and response of every trained row) per "
                        "second, and the trainer's own tokens/s of its last step.",
                        [
                            Target(
                                f"sum(rate(relayrl_trainer_trained_tokens_total{{{NS}}}[{RATE}]))",
                                "trained tokens / s",
                            ),
                            Target(step_value("tokens_per_s"), "step tokens / s"),
                        ],
                        min=0,
                    ),
                ],
            ),
            Row(
                "Learning",
                [
                    Panel(
                        "Reward mean / std",
                        "Over the valid trajectories of each step.",
                        [
                            Target(step_value("reward_mean"), "mean"),
                            Target(step_value("reward_std"), "std"),
                        ],
                        core=True,
                    ),
                    Panel(
                        "Loss / grad norm",
                        "Policy loss and gradient norm before clipping.",
                        [
                            Target(step_value("loss"), "loss"),
                            Target(step_value("grad_norm"), "grad norm"),
                        ],
                        core=True,
                    ),
                    Panel(
                        "KL (k1, k3, to reference) / learning rate",
                        "KL estimates of the update and to the reference model.",
                        [
                            Target(step_value("kl"), "kl"),
                            Target(step_value("k3_kl"), "k3 kl"),
                            Target(step_value("ref_kl"), "ref kl"),
                            Target(step_value("lr"), "lr"),
                        ],
                    ),
                    Panel(
                        "PPO clip fraction / approx KL",
                        "Share of tokens whose ratio was clipped.",
                        [
                            Target(step_value("pg_clipfrac"), "clip fraction"),
                            Target(step_value("pg_approx_kl"), "approx kl"),
                        ],
                    ),
                    Panel(
                        "Groups / s by verdict",
                        "Consumed or evicted groups: keep, stale, no_signal, no_valid, evicted.",
                        [
                            Target(
                                "sum by (verdict) (rate(relayrl_trainer_groups_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{verdict}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        stacked=True,
                        core=True,
                    ),
                    Panel(
                        "Response length p50: trained vs launched",
                        "A gap means long (or short) trajectories are filtered before training.",
                        [
                            Target(
                                quantile(0.5, "relayrl_trainer_trained_response_length_tokens", NS),
                                "trained",
                            ),
                            Target(
                                quantile(
                                    0.5, "relayrl_trainer_launched_response_length_tokens", NS
                                ),
                                "launched",
                            ),
                        ],
                        min=0,
                    ),
                ],
            ),
            Row(
                "Off-policy health",
                [
                    Panel(
                        "Trained staleness p50 / p99 vs bound",
                        "Staleness (step - prompt_step + 1) of trained groups; p99 above "
                        "the bound fires RelayrlStalenessP99AboveBound. Policy lag: versions "
                        "between the weights that sampled a group and the trained ones.",
                        [
                            Target(
                                quantile(0.5, "relayrl_trainer_trained_staleness_steps", NS), "p50"
                            ),
                            Target(
                                quantile(0.99, "relayrl_trainer_trained_staleness_steps", NS), "p99"
                            ),
                            Target(step_value("staleness_max"), "max (last step)"),
                            Target(f"max(relayrl_trainer_staleness_bound_steps{{{NS}}})", "bound"),
                            Target(step_value("policy_lag_mean"), "policy lag mean (last step)"),
                        ],
                        unit="none",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Trained staleness distribution",
                        "Trained groups per staleness bucket over the dashboard's range (the "
                        "histogram, not just the mean).",
                        [
                            Target(
                                "sum by (le) (increase("
                                f"relayrl_trainer_trained_staleness_steps_bucket{{{NS}}}[$__range]))",
                                "≤ {{le}}",
                                instant=True,
                            )
                        ],
                        kind="bargauge",
                        min=0,
                    ),
                    Panel(
                        "|log π_old - log μ| mean / p99 / max",
                        "Train/inference mismatch per token. p99 above 0.5 fires "
                        "RelayrlTrainInferenceMismatchHigh; a doubling of the mean fires "
                        "RelayrlTrainInferenceMismatchRising.",
                        [
                            Target(step_value("abs_log_ratio_mean"), "mean"),
                            Target(step_value("abs_log_ratio_p99"), "p99"),
                            Target(step_value("abs_log_ratio_max"), "max"),
                        ],
                        unit="none",
                        min=0,
                        thresholds=[GREEN, (0.5, "red")],
                        core=True,
                    ),
                    Panel(
                        "Mismatch: ppl ratio, log ppl diff, χ²",
                        "Sequence-level views of the same mismatch.",
                        [
                            Target(step_value("ppl_ratio"), "ppl ratio"),
                            Target(step_value("log_ppl_diff"), "log ppl diff"),
                            Target(step_value("chi2_token"), "chi2 token"),
                            Target(step_value("chi2_seq"), "chi2 seq"),
                        ],
                    ),
                    Panel(
                        "Importance weights: ESS, at cap, rejected",
                        "Effective sample size of w = π_old/μ, share of weights at the cap "
                        "(and of raw weights at or over it, whatever the correction), share of "
                        "tokens removed by rejection masks.",
                        [
                            Target(step_value("is_ess"), "ESS"),
                            Target(step_value("is_frac_capped"), "at cap"),
                            Target(step_value("is_raw_frac_over_cap"), "over cap, uncorrected"),
                            Target(step_value("rs_rejected_token_frac"), "rejected tokens"),
                        ],
                        unit="percentunit",
                        min=0,
                    ),
                    Panel(
                        "Staleness mean (last step) / wait for data",
                        "Mean staleness of the last step's groups and how long it waited.",
                        [
                            Target(step_value("staleness_mean"), "staleness mean"),
                            Target(step_value("wait_duration_s"), "wait (s)"),
                        ],
                        min=0,
                    ),
                ],
            ),
            Row(
                "TransferQueue (read by the trainer)",
                [
                    Panel(
                        "Groups by status",
                        "Prompt groups in the TransferQueue: pending → running → finished → "
                        "scored → consumed (or failure).",
                        [
                            Target(
                                f"max by (partition, status) (relayrl_trainer_tq_groups{{{tq}}})",
                                "{{partition}} {{status}}",
                            )
                        ],
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Trajectories by status",
                        "Trajectories in the TransferQueue by status.",
                        [
                            Target(
                                "max by (partition, status) (relayrl_trainer_tq_trajectories"
                                f"{{{tq}}})",
                                "{{partition}} {{status}}",
                            )
                        ],
                        min=0,
                    ),
                    Panel(
                        "Groups in flight by staleness",
                        "Groups pending, running, finished or scored, by their staleness at "
                        "the current step.",
                        [
                            Target(
                                f"sum by (staleness) (relayrl_trainer_tq_stale_groups{{{tq}}})",
                                "staleness {{staleness}}",
                            )
                        ],
                        min=0,
                        stacked=True,
                    ),
                    Panel(
                        "Dead-letter events",
                        "Events consumers gave up on; any fires RelayrlTransferQueueDeadLetters.",
                        [
                            Target(
                                "max by (partition) (relayrl_trainer_tq_dead_letter_events"
                                f"{{{tq}}})",
                                "{{partition}}",
                            )
                        ],
                        kind="stat",
                        thresholds=[GREEN, (1, "red")],
                    ),
                    Panel(
                        "Launched groups (throttle count)",
                        "Groups claimed and not returned to pending.",
                        [
                            Target(
                                f"max by (partition) (relayrl_trainer_tq_launched_groups{{{tq}}})",
                                "{{partition}}",
                            )
                        ],
                        min=0,
                    ),
                ],
            ),
        ],
        [
            Variable(
                "partition",
                "Partition",
                f"label_values(relayrl_trainer_tq_launched_groups{{{NS}}}, partition)",
                multi=True,
            )
        ],
    )


def weightsync() -> Dashboard:
    return Dashboard(
        "weightsync",
        "relayrl / Weight sync",
        "Turning a trainer step into a weight version on every engine: versions, transfers, "
        "the five boundaries (export, transport, switch, load, restore) and the rollout pause.",
        ["weightsync"],
        [
            Row(
                "Versions and transfers",
                [
                    Panel(
                        "Versions: published, committed, per replica",
                        "The trainer's published version, the version committed on every "
                        "live replica, and each replica's own.",
                        [
                            Target(
                                f"max(relayrl_trainer_published_policy_version{{{NS}}})",
                                "published (trainer)",
                            ),
                            Target(
                                f"max(relayrl_weightsync_committed_version{{{NS}}})", "committed"
                            ),
                            Target(
                                f"max by (replica) (relayrl_weightsync_replica_version{{{NS}}})",
                                "{{replica}}",
                            ),
                        ],
                        unit="none",
                        min=0,
                        width=12,
                        core=True,
                    ),
                    Panel(
                        "Transfers / s by outcome",
                        "planned, committed, failed.",
                        [
                            Target(
                                "sum by (outcome) (rate(relayrl_weightsync_transfers_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{outcome}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        width=12,
                        core=True,
                    ),
                    Panel(
                        "Failures / s by boundary",
                        "A replica that needs a retry counts once per attempt.",
                        [
                            Target(
                                "sum by (boundary) (rate(relayrl_weightsync_failures_total"
                                f"{{{NS}}}[{RATE}]))",
                                "{{boundary}}",
                            )
                        ],
                        unit="ops",
                        min=0,
                        thresholds=[GREEN, (0.0001, "red")],
                    ),
                    Panel(
                        "Failures in range by boundary",
                        "Failures over the dashboard's time range.",
                        [
                            Target(
                                "sum by (boundary) (increase(relayrl_weightsync_failures_total"
                                f"{{{NS}}}[$__range]))",
                                "{{boundary}}",
                                instant=True,
                            )
                        ],
                        kind="bargauge",
                        min=0,
                        thresholds=[GREEN, (1, "red")],
                    ),
                    Panel(
                        "Replica version lag",
                        "Committed version minus each replica's version; above 0 for 10 min "
                        "fires RelayrlEngineReplicaVersionLagging.",
                        [
                            Target(
                                f"max(relayrl_weightsync_committed_version{{{NS}}}) - on () "
                                "group_right max by (replica) ("
                                f"relayrl_weightsync_replica_version{{{NS}}})",
                                "{{replica}}",
                            )
                        ],
                        unit="none",
                        thresholds=[GREEN, (1, "red")],
                    ),
                ],
            ),
            Row(
                "Boundaries",
                [
                    Panel(
                        "Boundary duration p50 by boundary",
                        "export, transport, switch, load, restore (load and restore: per "
                        "replica), pause_window (rollout paused).",
                        [
                            Target(
                                quantile(
                                    0.5,
                                    "relayrl_weightsync_boundary_duration_seconds",
                                    NS,
                                    "boundary",
                                ),
                                "{{boundary}}",
                            )
                        ],
                        unit="s",
                        min=0,
                        width=12,
                        core=True,
                    ),
                    Panel(
                        "Boundary duration p90 by boundary",
                        "pause_window p90 above 60 s fires RelayrlWeightSyncSlow.",
                        [
                            Target(
                                quantile(
                                    0.9,
                                    "relayrl_weightsync_boundary_duration_seconds",
                                    NS,
                                    "boundary",
                                ),
                                "{{boundary}}",
                            )
                        ],
                        unit="s",
                        min=0,
                        width=12,
                        thresholds=[GREEN, (60, "red")],
                    ),
                ],
            ),
            Row(
                "Data plane",
                [
                    Panel(
                        "Bytes / s received from trainer ranks by transport",
                        "Bucket bytes received from senders.",
                        [
                            Target(
                                "sum by (transport) (rate("
                                f"relayrl_weightsync_transferred_bytes_total{{{NS}}}[{RATE}]))",
                                "{{transport}}",
                            )
                        ],
                        unit="Bps",
                        min=0,
                        core=True,
                    ),
                    Panel(
                        "Bytes / s delivered to engine workers by data plane",
                        "Each worker counts.",
                        [
                            Target(
                                "sum by (transport) (rate("
                                f"relayrl_weightsync_delivered_bytes_total{{{NS}}}[{RATE}]))",
                                "{{transport}}",
                            )
                        ],
                        unit="Bps",
                        min=0,
                    ),
                    Panel(
                        "Per-worker delivery rate (latest)",
                        "Bytes per second each engine worker received in the latest delivery.",
                        [
                            Target(
                                "max by (transport) ("
                                f"relayrl_weightsync_delivery_rate_bytes_per_second{{{NS}}})",
                                "{{transport}}",
                            )
                        ],
                        unit="Bps",
                        min=0,
                    ),
                    Panel(
                        "Gateway pause per update p50 / p90",
                        "Pause to resume as the rollout-gateway measures it.",
                        [
                            Target(
                                quantile(0.5, "relayrl_gateway_pause_duration_seconds", NS), "p50"
                            ),
                            Target(
                                quantile(0.9, "relayrl_gateway_pause_duration_seconds", NS), "p90"
                            ),
                        ],
                        unit="s",
                        min=0,
                    ),
                    Panel(
                        "weight-sync gRPC calls / s by method and code",
                        "Control-plane calls (plans, buckets, acks) handled by weight-sync.",
                        [
                            Target(
                                "sum by (method, code) (rate("
                                f"relayrl_weightsync_grpc_requests_total{{{NS}}}[{RATE}]))",
                                "{{method}} {{code}}",
                            )
                        ],
                        unit="reqps",
                        min=0,
                        width=16,
                    ),
                ],
            ),
        ],
    )


ALL = (overview, rollout, reward, trainer, weightsync)


def render() -> dict[Path, str]:
    """Every file this script owns, path -> content."""
    files: dict[Path, str] = {}
    core: list[dict[str, str]] = []
    for build in ALL:
        dashboard = build()
        model = dashboard_json(dashboard)
        files[DASHBOARDS / f"relayrl-{dashboard.name}.json"] = json.dumps(model, indent=2) + "\n"
        for row in dashboard.rows:
            for panel in row.panels:
                if panel.core:
                    for target in (t for t in panel.targets if not t.only_on_trouble):
                        core.append(
                            {"dashboard": model["uid"], "panel": panel.title, "expr": target.expr}
                        )
    files[CORE_PANELS] = json.dumps({"panels": core}, indent=2, ensure_ascii=False) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, content in render().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == content:
            continue
        if args.check:
            stale.append(str(path.relative_to(HERE)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
            print(f"wrote {path.relative_to(HERE)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run {Path(__file__).name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
