"""How `make test` shares the suite between its two pytest-xdist workers.

Much of the suite waits on subprocesses (vLLM booting, `relayrl up` runs, Helm and kind), so
two workers on this machine's two cores finish it in much less time than one. A unit of work
goes to one worker whole:

- every test that leases the session's shared vLLM engines (`engine`, `second_engine`): one
  worker boots them once and keeps them, as a serial run does;
- otherwise one test module, so its module-scoped fixtures are built once.

Units are sent longest first (longest-processing-time order, what keeps two workers' finishing
times close), by the seconds `tests/unit_costs.json` records for each; a unit it does not know
goes last. Refresh the file after adding or changing slow tests:

    make test PYTEST_ARGS="--write-unit-costs tests/unit_costs.json"

Only a worker collects, and only it sees which tests use which fixtures, so the workers write
each test's unit to a file the controller names in their input (tests/conftest.py), which its
scheduler reads once every worker has collected. (xdist's own `--dist loadgroup` renames node
ids to carry the group, which pytest 9's node ids no longer allow.)
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from relayrl.core.atomic import atomic_write_text
from relayrl_testkit import REPO

ENGINE_UNIT = "vllm-engines"
ENGINE_FIXTURES = ("shared_engine", "shared_second_engine")
COSTS = REPO / "tests" / "unit_costs.json"


def unit_of(item: pytest.Item) -> str:
    if any(name in item.fixturenames for name in ENGINE_FIXTURES):
        return ENGINE_UNIT
    return module_of(item.nodeid)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def recorded_costs(path: Path = COSTS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def order_by_unit(items: list[pytest.Item], costs: dict[str, float]) -> dict[str, str]:
    """Reorders `items` so that units come longest first, each contiguous, tests keeping their
    order within it; returns each test's unit by node id."""
    units: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        units[unit_of(item)].append(item)
    order = sorted(units, key=lambda unit: -costs.get(unit, 0.0))  # stable: ties keep order
    items[:] = [item for unit in order for item in units[unit]]
    return {item.nodeid: unit for unit in order for item in units[unit]}


def write_units(units: dict[str, str], path: Path) -> None:
    """Atomically: every worker writes the same content, the controller reads it whole."""
    atomic_write_text(path, json.dumps(units))


class UnitScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (a scope goes to one worker whole, in collection order), with
    the units the workers recorded as scopes."""

    def __init__(self, config: pytest.Config, units_file: Path, log: object = None) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        self._units_file = units_file
        self._units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            self._units = json.loads(self._units_file.read_text())
        return self._units.get(nodeid) or module_of(nodeid)


def unit_costs(durations: Iterable[tuple[str, float]], units: dict[str, str]) -> dict[str, float]:
    """Seconds per unit from (node id, duration) pairs of every test phase."""
    costs: dict[str, float] = defaultdict(float)
    for nodeid, duration in durations:
        costs[units.get(nodeid) or module_of(nodeid)] += duration
    return {unit: round(seconds, 1) for unit, seconds in sorted(costs.items())}
