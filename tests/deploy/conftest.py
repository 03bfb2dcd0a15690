"""The real tools the deploy checks run (installed by `make setup` through
deploy/tools/install.sh), and the repository paths they check."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "relayrl"
TOOLS = REPO / ".tools"


@dataclass(frozen=True)
class DeployTools:
    helm: Path
    kubectl: Path
    kubernetes_validate: Path
    checkov: Path
    promtool: Path
    prometheus: Path
    node_modules: Path  # kubernetes-models, @kubernetes-models/prometheus-operator, ajv


def _required(path: Path | str | None, what: str) -> Path:
    if path is None or not Path(path).exists():
        pytest.fail(f"{what} is missing: run `make setup` (deploy/tools/install.sh installs it)")
    return Path(path)


@pytest.fixture(scope="session")
def deploy_tools() -> DeployTools:
    return DeployTools(
        helm=_required(TOOLS / "bin" / "helm", "helm"),
        kubectl=_required(TOOLS / "bin" / "kubectl", "kubectl"),
        kubernetes_validate=_required(TOOLS / "bin" / "kubernetes-validate", "kubernetes-validate"),
        checkov=_required(TOOLS / "bin" / "checkov", "checkov"),
        promtool=_required(shutil.which("promtool"), "promtool (Debian prometheus)"),
        prometheus=_required(shutil.which("prometheus"), "prometheus (Debian prometheus)"),
        node_modules=_required(TOOLS / "npm" / "node_modules", "kubernetes-models (npm)"),
    )
