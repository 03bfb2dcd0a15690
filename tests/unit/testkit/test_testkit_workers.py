"""How `make test` cuts the suite into units for its workers (relayrl_testkit.helpers.workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl_testkit.helpers.workers import ENGINE_UNIT, order_by_unit, unit_costs


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple[str, ...] = ()


def test_units_are_modules_and_the_engines_lessees_longest_first_each_contiguous() -> None:
    items: list[Any] = [
        Item("tests/a.py::one"),
        Item("tests/a.py::leases", ("tmp_path", "engine", "shared_engine")),
        Item("tests/b.py::one"),
        Item("tests/c.py::two_engines", ("shared_engine", "shared_second_engine")),
        Item("tests/a.py::two"),
        Item("tests/new.py::one"),
    ]
    costs = {"tests/a.py": 5.0, "tests/b.py": 50.0, ENGINE_UNIT: 20.0}
    units = order_by_unit(items, costs)
    assert [item.nodeid for item in items] == [
        "tests/b.py::one",
        "tests/a.py::leases",
        "tests/c.py::two_engines",
        "tests/a.py::one",
        "tests/a.py::two",
        "tests/new.py::one",  # unknown cost: last
    ]
    assert units["tests/a.py::leases"] == units["tests/c.py::two_engines"] == ENGINE_UNIT
    assert units["tests/a.py::one"] == units["tests/a.py::two"] == "tests/a.py"


def test_costs_add_every_phase_of_every_test_of_a_unit() -> None:
    units = {"tests/a.py::x": ENGINE_UNIT, "tests/a.py::y": "tests/a.py"}
    durations = [("tests/a.py::x", 1.0), ("tests/a.py::x", 2.0), ("tests/a.py::y", 0.5)]
    durations.append(("tests/z.py::unknown", 4.0))  # not in the map: its module
    assert unit_costs(durations, units) == {
        ENGINE_UNIT: 3.0,
        "tests/a.py": 0.5,
        "tests/z.py": 4.0,
    }
