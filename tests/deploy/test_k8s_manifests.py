"""The kustomize manifests deploy/k8s: the base equals a fresh render of the Helm chart
(deploy/k8s/render.py), and `kubectl kustomize` of every overlay is valid for each supported
Kubernetes version (kubernetes-validate --strict; prometheus-operator objects by their
schemas) and keeps the chart's rules: probes, security, resources, accelerators, Service
ports, NetworkPolicies."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = tuple(sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir()))
EXPECTED_ACCELERATORS = {
    "cpu-demo": set(),
    "gpu": {"nvidia.com/gpu"},
    "npu": {"huawei.com/Ascend910"},
}
RELEASE_SELECTOR = {"app.kubernetes.io/name": "relayrl", "app.kubernetes.io/instance": "relayrl"}


def load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The structural checks are the chart's own (one definition for both).
chart_checks = load("relayrl_chart_checks", Path(__file__).with_name("test_helm_chart.py"))
render = load("relayrl_k8s_render", K8S / "render.py")


@pytest.fixture(scope="module")
def built(deploy_tools: Any) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for overlay in OVERLAYS:
        result = subprocess.run(
            [str(deploy_tools.kubectl), "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{overlay}: {result.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return out


def test_overlays_exist() -> None:
    assert set(EXPECTED_ACCELERATORS) <= set(OVERLAYS)


def test_base_is_a_fresh_render_of_the_chart(deploy_tools: Any) -> None:
    stale = [
        rel
        for rel, text in render.render(deploy_tools.helm).items()
        if (K8S / rel).read_text() != text
    ]
    assert stale == [], f"re-render: .venv/bin/python deploy/k8s/render.py ({stale})"


def test_every_overlay_object_is_valid_for_each_supported_kubernetes_version(
    deploy_tools: Any, built: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    kinds = {d["apiVersion"] for docs in built.values() for d in docs}
    assert chart_checks.CRD_API in kinds
    failures = chart_checks.kubernetes_validate(deploy_tools.kubernetes_validate, built, tmp_path)
    assert failures == {v: [] for v in chart_checks.K8S_VERSIONS}, failures
    crds = [d for docs in built.values() for d in docs if d["apiVersion"] == chart_checks.CRD_API]
    results = chart_checks.validate_crds(deploy_tools.node_modules, crds, tmp_path)
    assert len(results) == len(crds) and all(r["ok"] for r in results), results


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_keeps_the_chart_rules(
    built: dict[str, list[dict[str, Any]]], overlay: str, tmp_path: Path
) -> None:
    docs = built[overlay]
    assert chart_checks.probe_problems(docs) == []
    assert chart_checks.security_problems(docs) == []
    assert chart_checks.service_port_problems(docs) == []
    assert chart_checks.network_policy_problems(docs, RELEASE_SELECTOR) == []
    expected = EXPECTED_ACCELERATORS.get(overlay)
    if expected is not None:
        found = chart_checks.accelerators(docs)
        assert found == ({"engine": expected, "trainer": expected} if expected else {})
    # The overlays' env overrides (e.g. weight-sync's engine list) must still validate.
    assert chart_checks.check_service_configs(docs, tmp_path) == []


def test_overlay_checks_catch_a_broken_patch(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = [d for d in built["gpu"] if d["kind"] == "StatefulSet"]
    engine = next(d for d in docs if d["metadata"]["name"] == "relayrl-engine")
    engine["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu")
    with pytest.raises(AssertionError):
        chart_checks.accelerators(docs)
