"""Imports point one way (docs/architecture.md#package-layers): no package of relayrl imports
one above it, and the services import one another only along the two edges the document
names. Every import counts, also one inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

RELAYRL = Path(__file__).resolve().parents[3] / "services" / "relayrl"

# top first; packages on one line are one layer
LAYERS: list[set[str]] = [
    {"cli", "up"},
    {"stack"},
    {"gateway", "reward", "trainer", "weightsync", "tasks", "sim"},
    {"engine"},
    {"dataplane", "inference", "conversation", "models"},
    {"tq", "proto", "core"},
]
SERVICES = LAYERS[2]
# the sibling edges kept on purpose: (importer package, imported module prefix)
SIBLING_EDGES = {
    ("trainer", "relayrl.weightsync.sender"),
    ("trainer", "relayrl.tasks.datasets"),
    ("tasks", "relayrl.reward.managers.rules"),
    ("tasks", "relayrl.reward.items"),
}


def rank(package: str) -> int:
    for number, layer in enumerate(LAYERS):
        if package in layer:
            return number
    raise AssertionError(f"relayrl.{package} is in no layer of docs/architecture.md")


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of relayrl in `path`, relative ones resolved."""
    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    package_parts = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("relayrl.")]


def violations(root: Path = RELAYRL) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] == "proto":
            continue  # generated
        own = parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        for line, name in imported_modules(path, root):
            target = name.split(".")[1]
            if target == own or target == "__init__":
                continue
            where = f"{path.relative_to(root.parent)}:{line} imports {name}"
            if rank(target) < rank(own):
                found.append(f"{where} (a layer above)")
            elif own == "sim" or (
                own in SERVICES
                and target in SERVICES
                and not any(own == a and name.startswith(b) for a, b in SIBLING_EDGES)
            ):
                found.append(f"{where} (a sibling service)")
    return found


def test_no_package_imports_one_above_it_or_a_sibling_service() -> None:
    assert violations() == []


def test_the_check_sees_an_upward_import_and_a_sibling_one(tmp_path: Path) -> None:
    fake = tmp_path / "relayrl" / "trainer" / "probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "from relayrl.up import run\n"
        "def later():\n    from ..gateway import agents\n"
        "from relayrl.weightsync.sender import Sender\n"  # a named edge
        "from relayrl.core import config\n"
    )
    found = violations(tmp_path / "relayrl")
    assert found == [
        "relayrl/trainer/probe.py:1 imports relayrl.up.run (a layer above)",
        "relayrl/trainer/probe.py:3 imports relayrl.gateway.agents (a sibling service)",
    ]
