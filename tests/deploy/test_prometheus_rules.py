"""The Prometheus alert rules shipped in deploy/prometheus/rules: promtool accepts them and
their unit tests pass, every alert is tested firing and quiet, carries the labels and
annotations operators route on, has a runbook section, and reads only metrics the services
really export (derived from their registries, not from a list)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl_testkit import REPO
from relayrl_testkit.helpers.metric_inventory import (
    Family,
    expression_problems,
    service_families,
)

RULES_DIR = REPO / "deploy" / "prometheus" / "rules"
TESTS_DIR = REPO / "deploy" / "prometheus" / "tests"
OPERATIONS = REPO / "deploy" / "docs" / "operations.md"
RUNBOOK_BASE = "https://github.com/relayrl/relayrl/blob/main/deploy/docs/operations.md#"

# Issue #8's required alerts, by what they watch.
REQUIRED_ALERTS = {
    "staleness p99 over its bound": "RelayrlStalenessP99AboveBound",
    "train/inference mismatch rising": "RelayrlTrainInferenceMismatchRising",
    "reward backlog saturated": "RelayrlRewardBacklogSaturated",
    "reward error rate high": "RelayrlRewardErrorRateHigh",
    "weight-sync failing": "RelayrlWeightSyncFailing",
    "weight-sync slow": "RelayrlWeightSyncSlow",
    "engine replica down": "RelayrlEngineReplicaDown",
    "dead letters in the TransferQueue": "RelayrlTransferQueueDeadLetters",
    "trainer stalled": "RelayrlTrainerStalled",
}


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yaml"))


def unit_test_files() -> list[Path]:
    return sorted(TESTS_DIR.glob("*.yaml"))


def all_rules() -> list[dict]:
    rules = []
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(group["rules"])
    return rules


def alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in all_rules() if "alert" in rule}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as
    hyphens."""
    anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return anchor.replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """operations.md's level-2/3 headings by anchor -> the section's text."""
    text = OPERATIONS.read_text(encoding="utf-8")
    sections: dict[str, str] = {}
    parts = re.split(r"^(#{2,3}) (.+)$", text, flags=re.MULTILINE)
    for i in range(1, len(parts) - 2, 3):
        sections[github_anchor(parts[i + 1])] = parts[i + 2]
    return sections


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> list[Family]:
    return service_families(tmp_path_factory.mktemp("inventory"))


def test_rule_files_exist_and_pass_promtool_check(deploy_tools: Any) -> None:
    assert rule_files(), f"no rule files under {RULES_DIR}"
    for path in rule_files():
        result = subprocess.run(
            [deploy_tools.promtool, "check", "rules", path], capture_output=True, text=True
        )
        assert result.returncode == 0, f"{path.name}:\n{result.stdout}{result.stderr}"


def test_promtool_rejects_a_broken_rule_file(deploy_tools: Any, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "groups:\n  - name: x\n    rules:\n      - alert: Broken\n"
        "        expr: sum(rate(relayrl_gateway_rollouts_total[5m])\n"
    )
    result = subprocess.run(
        [deploy_tools.promtool, "check", "rules", broken], capture_output=True, text=True
    )
    assert result.returncode != 0


def test_promtool_unit_tests_pass(deploy_tools: Any) -> None:
    assert unit_test_files(), f"no promtool unit tests under {TESTS_DIR}"
    for path in unit_test_files():
        result = subprocess.run(
            [deploy_tools.promtool, "test", "rules", path.name],
            cwd=TESTS_DIR,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, f"{path.name}:\n{result.stdout}{result.stderr}"


def test_the_unit_tests_load_the_shipped_rule_files() -> None:
    shipped = {path.resolve() for path in rule_files()}
    for path in unit_test_files():
        loaded = {(TESTS_DIR / f).resolve() for f in yaml.safe_load(path.read_text())["rule_files"]}
        assert loaded <= shipped and loaded, f"{path.name} tests rules that do not ship: {loaded}"


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for path in unit_test_files():
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                seen = firing if check.get("exp_alerts") else quiet
                seen[check["alertname"]] = seen.get(check["alertname"], 0) + 1
    names = set(alerts())
    assert names, "no alerts defined"
    assert not names - set(firing), f"never tested firing: {sorted(names - set(firing))}"
    assert not names - set(quiet), f"never tested quiet: {sorted(names - set(quiet))}"
    assert not (set(firing) | set(quiet)) - names, "tests name alerts that do not exist"


def test_the_required_alerts_exist() -> None:
    missing = {what: name for what, name in REQUIRED_ALERTS.items() if name not in alerts()}
    assert not missing, f"issue #8 asks for alerts on: {missing}"


def test_every_alert_has_severity_annotations_and_a_runbook_section() -> None:
    sections = runbook_sections()
    for name, rule in alerts().items():
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), name
        annotations = rule.get("annotations", {})
        assert annotations.get("summary", "").strip(), f"{name}: no summary"
        assert annotations.get("description", "").strip(), f"{name}: no description"
        anchor = name.lower()
        assert annotations.get("runbook_url") == RUNBOOK_BASE + anchor, name
        assert anchor in sections, f"operations.md has no section '## {name}'"
        section = sections[anchor]
        for part in ("What it means", "Likely causes", "What to check", "What to do"):
            assert part in section, f"operations.md#{anchor} lacks '{part}'"


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in all_rules() if "alert" in rule]
    assert len(names) == len(set(names))


def test_every_rule_reads_only_exported_metrics_and_labels(families: list[Family]) -> None:
    problems = []
    for rule in all_rules():
        name = rule.get("alert") or rule.get("record")
        problems += [f"{name}: {p}" for p in expression_problems(rule["expr"], families)]
    assert not problems, "\n".join(problems)
