"""The Helm chart helm/relayrl, checked with the real tools: `helm lint --strict` and
`helm template` for the default values and every ci/*-values.yaml scenario,
`kubernetes-validate --strict` of every rendered object for each supported Kubernetes version,
the prometheus-operator objects against their schemas (deploy/tools/validate-crds.mjs), every
rendered service config through the service's own `--print-config` validation, and structural
rules (probes, security, resources, accelerators, Service ports, NetworkPolicies)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "relayrl"
K8S_RENDER = REPO / "deploy" / "k8s" / "render.py"

# Kubernetes versions the chart claims (Chart.yaml kubeVersion; deploy/docs/deploying.md).
K8S_VERSIONS = ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0")
CRD_API = "monitoring.coreos.com/v1"
SCENARIOS = (
    "default",
    *sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml")),
)
RELEASE, NAMESPACE = "rr-test", "relayrl-test"
UPSTREAM_RUNBOOK = "https://github.com/relayrl/relayrl/blob/main/deploy/docs"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
SERVICES = ("gateway", "reward", "weightsync", "trainer")
EXPECTED_ACCELERATORS = {
    "default": set(),
    "agents": set(),
    "cpu-demo": set(),
    "external-redis": set(),
    "tls": set(),
    "gpu-separate-async": {"nvidia.com/gpu"},
    "npu": {"huawei.com/Ascend910"},
}


# -- fixtures ----------------------------------------------------------------------------------


def _load_render() -> Any:
    spec = importlib.util.spec_from_file_location("relayrl_k8s_render_for_chart", K8S_RENDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The chart with its symlinked dashboards and rules copied in: render.py's own copy.
copy_chart = _load_render().copy_chart


@pytest.fixture(scope="session")
def chart_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_chart(tmp_path_factory.mktemp("chart"))


def values_args(scenario: str) -> list[str]:
    return [] if scenario == "default" else ["-f", str(CHART / "ci" / f"{scenario}-values.yaml")]


def helm_template(helm: Path, chart: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), "template", RELEASE, str(chart), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="session")
def rendered(deploy_tools: Any, chart_copy: Path) -> dict[str, list[dict[str, Any]]]:
    """scenario -> the objects `helm template` renders for it (rendered once per session)."""

    def one(scenario: str) -> list[dict[str, Any]]:
        result = helm_template(deploy_tools.helm, chart_copy, *values_args(scenario))
        assert result.returncode == 0, f"{scenario}: {result.stderr}"
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(SCENARIOS, pool.map(one, SCENARIOS), strict=True))


# -- shared checks (also used on the kustomize output by test_k8s_manifests.py's twin) -------


def obj_id(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def kubernetes_validate(
    tool: Path, docs_by_label: dict[str, list[dict[str, Any]]], workdir: Path
) -> dict[str, list[str]]:
    """Run `kubernetes-validate --strict` once per supported version over every distinct
    non-CRD object (one file per object, named after its first scenario: most objects render
    alike in several scenarios, and each is validated once); version -> failure lines."""
    files: dict[str, str] = {}  # the object's canonical text -> its file
    for label, docs in docs_by_label.items():
        for n, doc in enumerate(docs):
            key = json.dumps(doc, sort_keys=True)
            if doc["apiVersion"] == CRD_API or key in files:
                continue
            path = workdir / f"{label}__{n:03d}__{doc['kind']}.yaml"
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            files[key] = str(path)
    assert files, "nothing to validate"

    def run(version: str) -> tuple[str, list[str]]:
        result = subprocess.run(
            [str(tool), "--strict", "--no-warn", "-k", version, *files.values()],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = (result.stdout + result.stderr).splitlines()
        problems = [line for line in lines if not line.startswith("INFO")]
        if result.returncode != 0 and not problems:
            problems = [f"exit code {result.returncode}"]
        return version, problems

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, K8S_VERSIONS))


def validate_crds(node_modules: Path, docs: list[dict[str, Any]], workdir: Path) -> list[dict]:
    path = workdir / "crds.json"
    path.write_text(json.dumps(docs))
    result = subprocess.run(
        [
            "node",
            str(REPO / "deploy" / "tools" / "validate-crds.mjs"),
            str(node_modules),
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(owner object, pod spec) of every workload and bare Pod."""
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            template = doc["spec"].get("jobTemplate", {}).get("spec", doc["spec"])["template"]
            yield doc, template["spec"]
        elif doc["kind"] == "Pod":
            yield doc, doc["spec"]


def is_helm_test(doc: dict[str, Any]) -> bool:
    return doc["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"


def probe_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Every long-running container has readiness and liveness probes on a port it declares
    (or an exec probe running a health check)."""
    problems = []
    for owner, spec in pod_specs(docs):
        if owner["kind"] in ("Job", "Pod"):
            continue
        for c in spec["containers"]:
            where = f"{obj_id(owner)}/{c['name']}"
            ports = {p["containerPort"] for p in c.get("ports", [])}
            names = {p["name"] for p in c.get("ports", []) if "name" in p}
            for kind in ("readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    problems.append(f"{where}: no {kind}")
                    continue
                handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
                if handler is not None:
                    if handler["port"] not in ports | names:
                        problems.append(f"{where}: {kind} port {handler['port']} not declared")
                elif "exec" in probe:
                    command = " ".join(probe["exec"]["command"])
                    if "relayrl.core.healthcheck" not in command and "redis-cli" not in command:
                        problems.append(f"{where}: {kind} exec runs no health check: {command}")
                else:
                    problems.append(f"{where}: {kind} has no handler")
    return problems


# The one exception to "non-root, nothing added": the reward pod's sandbox container runs as
# root with exactly these, so that candidate code gets a network namespace and a uid of its own
# (docs/security.md#the-code-sandbox-in-a-pod). Every other rule holds for it too.
SANDBOX_CAPABILITIES = ["SYS_ADMIN", "SETUID", "SETGID", "KILL", "CHOWN", "DAC_OVERRIDE", "FOWNER"]


def security_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for owner, spec in pod_specs(docs):
        pod_sc = spec.get("securityContext", {})
        component = owner["metadata"]["labels"].get("app.kubernetes.io/component")
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{obj_id(owner)}/{c['name']}"
            sc = c.get("securityContext", {})
            non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
            added = sc.get("capabilities", {}).get("add", [])
            if component == "reward" and c["name"] == "sandbox":
                if added != SANDBOX_CAPABILITIES:
                    problems.append(f"{where}: adds {added}, not exactly {SANDBOX_CAPABILITIES}")
            elif non_root is not True or not uid:
                problems.append(f"{where}: not forced to a non-root uid")
            elif added:
                problems.append(f"{where}: adds capabilities {added}")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]:
                problems.append(f"{where}: capabilities not dropped")
            if seccomp != "RuntimeDefault":
                problems.append(f"{where}: seccomp profile is {seccomp}")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: root filesystem is writable")
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(part, {}))
                if missing:
                    problems.append(f"{where}: no {part} for {sorted(missing)}")
    return problems


def accelerators(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Component -> extended resource names its containers request (cpu/memory aside)."""
    found: dict[str, set[str]] = {}
    for owner, spec in pod_specs(docs):
        component = owner["metadata"]["labels"].get("app.kubernetes.io/component", "?")
        for c in spec["containers"]:
            requests = c.get("resources", {}).get("requests", {})
            limits = c.get("resources", {}).get("limits", {})
            extended = {k for k in requests if "/" in k}
            assert extended == {k for k in limits if "/" in k}, (
                f"{obj_id(owner)}: requests != limits"
            )
            if extended:
                found.setdefault(component, set()).update(extended)
    return found


def service_port_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Every Service selects pods, and each of its ports targets a named port that those pods'
    containers declare."""
    problems = []
    pods = list(pod_specs(docs))
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"].get("selector", {})
        matched = [
            spec
            for owner, spec in pods
            if selector
            and not is_helm_test(owner)
            and selector.items()
            <= (
                (owner["spec"].get("template") or owner)["metadata"]["labels"] | pod_extra(owner)
            ).items()
        ]
        if not matched:
            problems.append(f"{obj_id(svc)}: selects no pods")
            continue
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if not isinstance(target, str):
                problems.append(f"{obj_id(svc)}: port {port['name']} targets a number, not a name")
                continue
            for spec in matched:
                declared = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
                if target not in declared:
                    problems.append(f"{obj_id(svc)}: targetPort {target} not declared by its pods")
    return problems


def pod_extra(owner: dict[str, Any]) -> dict[str, str]:
    """Labels Kubernetes adds to StatefulSet pods (pod 0's name, for selectors of rank 0)."""
    if owner["kind"] == "StatefulSet":
        return {"statefulset.kubernetes.io/pod-name": f"{owner['metadata']['name']}-0"}
    return {}


def network_policy_problems(
    docs: list[dict[str, Any]], release_selector: dict[str, str]
) -> list[str]:
    """Ingress from outside the release's pods is allowed only to the gateway's agent port,
    the reward-service's gRPC port, and metrics ports from the monitoring namespace; a
    default-deny policy covers every pod of the release."""
    problems = []
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not any(
        p["spec"]["podSelector"].get("matchLabels") == release_selector
        and not p["spec"].get("ingress")
        for p in policies
    ):
        problems.append("no default-deny ingress policy over the release's pods")
    for p in policies:
        component = (
            p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
        )
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from", [])
            ports = {str(x["port"]) for x in rule.get("ports", [])} or {"*"}
            internal = peers and all(
                set(release_selector.items())
                <= set(peer.get("podSelector", {}).get("matchLabels", {}).items())
                and "namespaceSelector" not in peer
                and "ipBlock" not in peer
                for peer in peers
            )
            if internal:
                continue
            monitoring = (
                peers
                and all(
                    "namespaceSelector" in peer and peer["namespaceSelector"] != {}
                    for peer in peers
                )
                and ports <= {"metrics", "http"}
            )
            if monitoring and not (component == "engine" and ports != {"http"}):
                continue
            allowed = {("gateway", "agent"), ("reward", "grpc")}
            if not all((component, port) in allowed for port in ports):
                problems.append(
                    f"{obj_id(p)}: admits peers outside the release to ports {sorted(ports)}"
                )
    return problems


def check_service_configs(docs: list[dict[str, Any]], workdir: Path) -> list[str]:
    """Run every rendered service config (with the plain RELAYRL_* env of its container)
    through the service's own validation; problems as lines."""
    configs = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["data"]["config.yaml"]
        for d in docs
        if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})
    }
    for d in docs:  # the reward pod's sandbox container (relayrl-sandbox)
        if d["kind"] == "ConfigMap" and "sandbox.yaml" in d.get("data", {}):
            configs["sandbox"] = d["data"]["sandbox.yaml"]
    envs: dict[str, dict[str, str]] = {}
    for owner, spec in pod_specs(docs):
        component = owner["metadata"]["labels"].get("app.kubernetes.io/component")
        for c in spec["containers"]:
            if c["name"] == component:
                envs[component] = {
                    e["name"]: e["value"]
                    for e in c.get("env", [])
                    if e["name"].startswith("RELAYRL_") and "value" in e
                }
    missing = {*SERVICES, "engine"} - set(configs)
    problems = [f"no config for {sorted(missing)}"] if missing else []
    model = workdir / "model"
    model.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    bin_dir = Path(sys.executable).parent

    def run(component: str) -> str | None:
        path = workdir / f"{component}.yaml"
        path.write_text(configs[component])
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYRL_")}
        env |= envs.get(component, {})
        if component == "engine":
            # The model folder is a mount in the pod; only its existence is checked here.
            env["RELAYRL_ENGINE__MODEL"] = str(model)
            argv = [
                sys.executable,
                "-m",
                "relayrl.engine",
                "--config",
                str(path),
                "--print-command",
            ]
        else:
            argv = [str(bin_dir / f"relayrl-{component}"), "--config", str(path), "--print-config"]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        if result.returncode != 0:
            return f"{component}: {result.stderr.strip()}"
        return None

    with ThreadPoolExecutor(2) as pool:
        problems += [p for p in pool.map(run, sorted(configs)) if p]
    return problems


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict(deploy_tools: Any, chart_copy: Path, scenario: str) -> None:
    result = subprocess.run(
        [str(deploy_tools.helm), "lint", "--strict", str(chart_copy), *values_args(scenario)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_scenarios_cover_the_required_installs() -> None:
    assert {"cpu-demo", "gpu-separate-async", "external-redis", "npu"} <= set(SCENARIOS)


def test_every_object_is_valid_for_each_supported_kubernetes_version(
    deploy_tools: Any, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    kinds = {(d["apiVersion"], d["kind"]) for docs in rendered.values() for d in docs}
    crd_kinds = {k for k in kinds if k[0] == CRD_API}
    assert crd_kinds == {(CRD_API, "ServiceMonitor"), (CRD_API, "PrometheusRule")}
    failures = kubernetes_validate(deploy_tools.kubernetes_validate, rendered, tmp_path)
    assert failures == {version: [] for version in K8S_VERSIONS}, failures


def test_kubernetes_validate_rejects_a_broken_object(deploy_tools: Any, tmp_path: Path) -> None:
    broken = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "broken"},
        "spec": {"ports": [{"port": "not-a-number"}], "selectr": {"a": "b"}},
    }
    failures = kubernetes_validate(deploy_tools.kubernetes_validate, {"neg": [broken]}, tmp_path)
    assert all(failures[v] for v in K8S_VERSIONS), failures


def test_prometheus_operator_objects_match_their_schemas(
    deploy_tools: Any, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    crds = [d for docs in rendered.values() for d in docs if d["apiVersion"] == CRD_API]
    broken = json.loads(json.dumps(next(d for d in crds if d["kind"] == "ServiceMonitor")))
    broken["metadata"]["name"] = "broken"
    broken["spec"]["endpoints"][0]["relabelings"][0]["action"] = "rename"
    results = validate_crds(deploy_tools.node_modules, [*crds, broken], tmp_path)
    assert len(results) == len(crds) + 1
    assert [r for r in results[:-1] if not r["ok"]] == []
    assert results[-1]["ok"] is False and "action" in results[-1]["error"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_containers_have_probes_security_and_resources(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    docs = rendered[scenario]
    assert probe_problems(docs) == []
    assert security_problems(docs) == []


def test_probe_and_security_checks_catch_a_bad_container(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    bad = json.loads(json.dumps(next(d for d in rendered["default"] if d["kind"] == "Deployment")))
    container = bad["spec"]["template"]["spec"]["containers"][0]
    del container["livenessProbe"]
    container["readinessProbe"] = {"httpGet": {"path": "/", "port": 1234}}
    container["securityContext"]["allowPrivilegeEscalation"] = True
    del container["resources"]["limits"]
    assert len(probe_problems([bad])) == 2
    assert len(security_problems([bad])) == 2


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_accelerators_by_resource_name(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    found = accelerators(rendered[scenario])
    expected = EXPECTED_ACCELERATORS[scenario]
    if expected:
        assert found == {"engine": expected, "trainer": expected}
    else:
        assert found == {}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_service_ports_target_declared_container_ports(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    docs = rendered[scenario]
    assert service_port_problems(docs) == []
    broken = json.loads(json.dumps(next(d for d in docs if d["kind"] == "Service")))
    broken["spec"]["ports"][0]["targetPort"] = "nope"
    assert service_port_problems([*docs, broken]) != []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_network_policies_admit_outsiders_only_to_agent_and_tenant_ports(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    docs = rendered[scenario]
    release = {"app.kubernetes.io/name": "relayrl", "app.kubernetes.io/instance": RELEASE}
    assert network_policy_problems(docs, release) == []
    opened = json.loads(
        json.dumps(
            next(
                d
                for d in docs
                if d["metadata"]["name"].endswith("-relayrl-weightsync")
                and d["kind"] == "NetworkPolicy"
            )
        )
    )
    opened["spec"]["ingress"].append(
        {"from": [{"namespaceSelector": {}}], "ports": [{"port": "grpc"}]}
    )
    assert len(network_policy_problems([*docs, opened], release)) == 1


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_service_configs_pass_the_services_own_validation(
    rendered: dict[str, list[dict[str, Any]]], scenario: str, tmp_path: Path
) -> None:
    assert check_service_configs(rendered[scenario], tmp_path) == []


def test_service_config_validation_catches_a_bad_config(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = json.loads(json.dumps(rendered["default"]))
    config = next(
        d for d in docs if d["metadata"]["name"].endswith("-trainer") and d["kind"] == "ConfigMap"
    )
    config["data"]["config.yaml"] = config["data"]["config.yaml"].replace(
        "mode: separate_async", "mode: sync"
    )  # eta 1 is not allowed in sync mode
    problems = check_service_configs(docs, tmp_path)
    assert len(problems) == 1 and "eta" in problems[0], problems


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "gateway.bogus=1"], "additional properties 'bogus' not allowed"),
        (["--set", "engine.replicas=two"], "/engine/replicas"),
        (["--set", "training.mode=async"], "/training/mode"),
        (["--set", "training.eta=-1"], "/training/eta"),
        (["--set", "trainer.accelerator.count=-2"], "/trainer/accelerator/count"),
        (["--set", "redis.external.url=http://x"], "/redis/external/url"),
        (["--set", "training.mode=sync"], "training.mode sync needs training.eta 0"),
        (["--set", "trainer.replicas=3"], "must equal it"),
        (["--set", "redis.enabled=false"], "redis.external.url is required"),
        (
            ["--set", "tls.enabled=true", "--set", "tls.services={weightsync}"],
            "tls.existingSecret is required",
        ),
        (
            [
                "--set",
                "redis.enabled=false",
                "--set",
                "redis.external.url=redis://r:6379/0",
                "--set",
                "tls.enabled=true",
                "--set",
                "tls.existingSecret=s",
                "--set",
                "tls.services={redis}",
            ],
            "redis is the chart's own Redis",
        ),
        (["--set", "data.trainFiles={train.jsonl}"], "data.trainFiles needs data.volume"),
        (
            [
                "--set",
                "data.trainFiles={train.jsonl}",
                "--set",
                "data.volume.emptyDir.medium=",
                "--set",
                "trainer.prompts.inline[0].prompt=hi",
            ],
            "give one source of prompts",
        ),
        (["--set", "data.trainFiles={/abs.jsonl}"], "/data/trainFiles/0"),
    ],
)
def test_bad_values_fail_with_a_clear_message(
    deploy_tools: Any, chart_copy: Path, args: list[str], message: str
) -> None:
    result = helm_template(deploy_tools.helm, chart_copy, *args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_schema_closes_every_object() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path)
            for key, child in node.items():
                walk(child, f"{path}/{key}")
        elif isinstance(node, list):
            for n, child in enumerate(node):
                walk(child, f"{path}/{n}")

    walk(schema, "")
    assert open_objects == []
    values = (CHART / "values.yaml").read_text()
    assert values.startswith("# yaml-language-server: $schema=values.schema.json")


def test_every_values_key_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for n, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line) and "#" not in line:
            above = lines[n - 1].strip() if n else ""
            if not above.startswith("#"):
                undocumented.append(line.strip())
    assert undocumented == []


def test_multi_pod_trainer_rendezvous_at_rank_zero(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["gpu-separate-async"]
    trainer = next(
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-trainer")
    )
    env = {e["name"]: e for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}
    headless = trainer["spec"]["serviceName"]
    name = trainer["metadata"]["name"]
    assert env["MASTER_ADDR"]["value"] == f"{name}-0.{headless}.{NAMESPACE}.svc.cluster.local"
    assert env["WORLD_SIZE"]["value"] == str(trainer["spec"]["replicas"]) == "2"
    assert "apps.kubernetes.io/pod-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert trainer["spec"]["podManagementPolicy"] == "Parallel"
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == headless)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


def test_the_trainer_reads_a_dataset_from_its_volume(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["gpu-separate-async"]
    config_map = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-trainer")
    )
    data = yaml.safe_load(config_map["data"]["config.yaml"])["data"]
    assert data["train_files"] == ["/data/dataset/math/train.parquet"]
    assert data["heldout_files"] == ["/data/dataset/math/test.parquet"]
    assert "prompts_file" not in data
    trainer = next(
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-trainer")
    )
    pod = trainer["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "dataset")
    assert volume["persistentVolumeClaim"] == {"claimName": "math-dataset", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "dataset")
    assert mount == {"name": "dataset", "mountPath": "/data/dataset", "readOnly": True}


def test_agent_programs_come_from_their_image_and_run_in_the_gateway(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["agents"]
    config_map = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-gateway")
    )
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["rollout"]["default_agent"] == "tool-agent"
    external = config["agents"]["external"]
    assert external == {
        "tool-agent": {
            "command": ["python", "/opt/agents/http_tool_agent.py", "--serve"],
            "deadline_s": 300.0,
            "max_concurrent": 32,
            "serve": True,
        },
        "verifier": {
            "command": ["/opt/agents/venv/bin/python", "/opt/agents/verifier_env.py"],
            "env": {"VERIFIER_MODE": "strict"},
            "deadline_s": 600.0,
            "max_concurrent": 8,
        },
    }
    gateway = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway")
    )
    pod = gateway["spec"]["template"]["spec"]
    (init,) = [c for c in pod["initContainers"] if c["name"] == "agents"]
    assert init["image"] == "registry.example.com/team-a/agents:1.4.0"
    assert init["command"] == ["cp", "-R", "/agents/.", "/opt/agents/"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "agents")
    assert mount == {"name": "agents", "mountPath": "/opt/agents", "readOnly": True}
    assert {"name": "agents", "emptyDir": {}} in pod["volumes"]
    # without agents nothing of it is rendered
    default = next(
        d
        for d in rendered["default"]
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway")
    )
    assert "agents" not in json.dumps(default["spec"]["template"]["spec"]["volumes"])


def test_engines_are_discoverable_and_listed(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu-separate-async"]
    configs = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: yaml.safe_load(
            d["data"]["config.yaml"]
        )
        for d in docs
        if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})
    }
    engine = next(
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-engine")
    )
    svc = next(
        d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == engine["spec"]["serviceName"]
    )
    assert svc["spec"]["clusterIP"] == "None"
    assert configs["gateway"]["engines"]["kubernetes"]["service"] == svc["metadata"]["name"]
    assert engine["spec"]["replicas"] == 2
    # one membership: the gateway registers what it discovers with weight-sync, which lists
    # no engines of its own (a second list would name the same engines under other ids)
    assert "urls" not in configs["weightsync"].get("engines", {})
    weightsync = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-weightsync")
    )
    assert configs["gateway"]["weightsync"]["target"].startswith(
        f"dns:///{weightsync['metadata']['name']}."
    ), configs["gateway"]["weightsync"]
    # and it keeps the committed version where a restarted pod finds it
    deployment = next(
        d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-weightsync")
    )
    pod = deployment["spec"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "state"]
    assert mount["mountPath"] == configs["weightsync"]["state_dir"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "state"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    claims = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert claim in claims
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_monitoring_objects(
    deploy_tools: Any, chart_copy: Path, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered["default"]
    monitors = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] == "ServiceMonitor"
    }
    assert set(monitors) == {*SERVICES, "engine"}
    for monitor in monitors.values():
        relabel = monitor["spec"]["endpoints"][0]["relabelings"]
        assert {
            "action": "replace",
            "sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_component"],
            "targetLabel": "component",
        } in relabel
    dashboards = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    assert len(dashboards) == len(
        list((chart_copy / "files" / "grafana" / "dashboards").glob("*.json"))
    )
    for d in dashboards:
        (body,) = d["data"].values()
        json.loads(body)
    result = helm_template(
        deploy_tools.helm,
        chart_copy,
        "--set",
        "monitoring.runbookBaseUrl=https://runbooks.example/relayrl",
    )
    rule = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "PrometheusRule")
    urls = [
        r["annotations"]["runbook_url"]
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if "runbook_url" in r.get("annotations", {})
    ]
    assert urls and all(u.startswith("https://runbooks.example/relayrl/") for u in urls), urls


def test_redis_is_durable_and_authenticated(rendered: dict[str, list[dict[str, Any]]]) -> None:
    redis = next(
        d
        for d in rendered["default"]
        if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-redis")
    )
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    external = rendered["external-redis"]
    assert not [
        d for d in external if d["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"
    ]


def test_services_authenticate_each_other_and_each_pod_holds_only_its_own_token(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["default"]
    secret = next(
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-identities")
    )
    data = secret["stringData"]
    digests = yaml.safe_load(data["tokens.yaml"])
    # the services', the operator's, and the agents' (agent frameworks open sessions with it)
    assert set(digests) == {"trainer", "weightsync", "gateway", "operator", "agent"}
    for principal, digest in digests.items():
        token = data[f"{principal}.token"]
        assert len(token) >= 32 and digest == "sha256:" + hashlib.sha256(token.encode()).hexdigest()
    for component in ("trainer", "weightsync", "gateway", "reward", "engine"):
        pod = next(
            d["spec"]["template"]["spec"]
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
        )
        volumes = [v for v in pod["volumes"] if v["name"] == "identity"]
        if component == "reward":  # its callers are tenants: nothing of the services' tokens
            assert volumes == [], component
            continue
        keys = [item["key"] for item in volumes[0]["secret"]["items"]]
        own = [] if component == "engine" else [f"{component}.token"]  # it calls no one
        assert keys == ["tokens.yaml", *own], component


def test_the_reward_api_is_authenticated_with_shared_small_quotas_by_default(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["default"]
    config = yaml.safe_load(
        next(
            d["data"]["config.yaml"]
            for d in docs
            if d["kind"] == "ConfigMap"
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == "reward"
            and "config.yaml" in d.get("data", {})
        )
    )
    assert config["auth"]["type"] == "static_token"
    assert config["quota_store"] == "redis"
    assert config["tenant_defaults"] == {"requests_per_minute": 120, "tokens_per_minute": 200000}
    tenants = next(
        d
        for d in docs
        if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-reward-tenants")
    )
    made = tenants["stringData"]
    assert yaml.safe_load(made["tokens.yaml"]) == {"default": made["default.token"]}
    assert len(made["default.token"]) >= 32


def test_candidate_code_runs_in_a_sandbox_container_without_secrets(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    def reward_pod(scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
        docs = rendered[scenario]
        deployment = next(
            d
            for d in docs
            if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-reward")
        )
        config_map = next(
            d
            for d in docs
            if d["kind"] == "ConfigMap" and d["metadata"]["name"] == deployment["metadata"]["name"]
        )
        return deployment["spec"]["template"]["spec"], config_map["data"]

    spec, data = reward_pod("default")
    assert [c["name"] for c in spec["containers"]] == ["reward"] and "sandbox.yaml" not in data

    spec, data = reward_pod("gpu-separate-async")
    containers = {c["name"]: c for c in spec["containers"]}
    sandbox, reward = containers["sandbox"], containers["reward"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    # the sandbox container mounts its config, the socket and its work dir: no Secret, no
    # service-account token, no TLS material
    mounted = {m["name"]: volumes[m["name"]] for m in sandbox["volumeMounts"]}
    assert set(mounted) == {"config", "sandbox-socket", "sandbox-work"}
    assert all("secret" not in v and "projected" not in v for v in mounted.values())
    assert spec["automountServiceAccountToken"] is False
    assert sandbox["securityContext"]["runAsUser"] == 0
    assert "add" not in reward["securityContext"]["capabilities"]
    # the reward container reaches it through the shared socket, and only its uid may call
    socket_path = "/run/relayrl-sandbox/sandbox.sock"
    assert any(m["name"] == "sandbox-socket" for m in reward["volumeMounts"])
    service = yaml.safe_load(data["sandbox.yaml"])
    assert service["socket"] == socket_path
    assert service["allow_uids"] == [spec["securityContext"]["runAsUser"]]
    assert service["sandbox"]["time_limit_s"] == 10
    config = yaml.safe_load(data["config.yaml"])
    assert config["managers"]["code"] == {
        "type": "sandbox_remote",
        "socket": socket_path,
        "max_concurrent": service["sandbox"]["max_concurrent"],
    }
    assert config["tq_scorer"]["managers_by_data_source"] == {"code": "code"}
    assert config["managers"]["naive"] == {"type": "naive"}  # the default manager stays


@pytest.mark.parametrize(
    ("args", "warnings"),
    [
        ([], []),
        (["--set", "security.authenticate=false"], ["security.authenticate is false"]),
        (["--set", "reward.auth.type=none"], ["reward.auth.type is none"]),
    ],
)
def test_notes_warn_about_open_access(
    deploy_tools: Any, chart_copy: Path, args: list[str], warnings: list[str]
) -> None:
    result = subprocess.run(
        [str(deploy_tools.helm), "install", "--dry-run=client", RELEASE, str(chart_copy),
         "--namespace", NAMESPACE, *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    manifests, notes = result.stdout.split("NOTES:")
    found = [line for line in notes.splitlines() if line.startswith("WARNING")]
    assert len(found) == len(warnings) and all(w in f for w, f in zip(warnings, found, strict=True))
    assert ("-identities" in manifests) == ("security.authenticate=false" not in args)


def test_callers_of_tls_peers_dial_them_over_tls_with_the_mounted_ca(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["tls"]
    configs = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: yaml.safe_load(
            d["data"]["config.yaml"]
        )
        for d in docs
        if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})
    }
    peer_tls = {
        "ca_file": "/etc/relayrl/peer-tls/ca.crt",
        "cert_file": "/etc/relayrl/peer-client/tls.crt",
        "key_file": "/etc/relayrl/peer-client/tls.key",
    }
    dialled = {  # caller -> its sections that dial a TLS peer
        "trainer": [configs["trainer"]["gateway"], configs["trainer"]["publish"]],
        "weightsync": [configs["weightsync"]["gateway"]],
        "gateway": [configs["gateway"]["weightsync"]],
        # the engines' workers pull the weights from weight-sync
        "engine": [{"tls": configs["engine"]["weightsync_tls"]}],
    }
    for user in ("gateway", "reward", "trainer"):  # the chart's Redis, TLS only
        dialled.setdefault(user, []).append(configs[user]["tq"])
        assert configs[user]["tq"]["url"].startswith("rediss://")
    for caller, sections in dialled.items():
        assert all(section["tls"] == peer_tls for section in sections), caller
        pod = next(
            d["spec"]["template"]["spec"]
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == caller
        )
        mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert mounts["peer-tls"] == "/etc/relayrl/peer-tls", caller
        assert mounts["peer-client"] == "/etc/relayrl/peer-client", caller
    redis = next(
        d["spec"]["template"]["spec"]["containers"][0]
        for d in docs
        if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-redis")
    )
    args = redis["args"]
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-port") + 1] == "6379"
    assert args[args.index("--tls-auth-clients") + 1] == "yes"  # mutual
    assert "--tls" in redis["readinessProbe"]["exec"]["command"][-1]
    # the default install dials the gateway in plaintext
    default = next(
        yaml.safe_load(d["data"]["config.yaml"])
        for d in rendered["default"]
        if d["kind"] == "ConfigMap"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"
        and "config.yaml" in d.get("data", {})
    )
    assert "tls" not in default["gateway"] and "tls" not in default["publish"]
