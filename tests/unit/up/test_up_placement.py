"""`placement`: CPU sets for the engine, the trainer and the services, checked against what
this machine offers, and inherited by a child spawned under them."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from relayrl.up.config import PlacementSection, UpConfig, parse_cpu_list
from relayrl.up.supervisor import Supervisor


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    for bad in ("", "a", "3-1", "0,,1", "-1"):
        with pytest.raises(ValueError, match=r"CPU list|backwards"):
            parse_cpu_list(bad)


def test_each_child_gets_its_part_and_a_cpu_that_is_not_here_is_refused() -> None:
    cpu = min(os.sched_getaffinity(0))
    placement = UpConfig.model_validate(
        {"placement": {"engine": str(cpu), "trainer": str(cpu)}}
    ).placement
    assert placement.cpus_for("engine-0") == {cpu}
    assert placement.cpus_for("trainer") == {cpu}
    assert placement.cpus_for("gateway") is None  # services: anywhere
    with pytest.raises(ValidationError, match=r"(?s)placement\.trainer.*not available here"):
        UpConfig.model_validate({"placement": {"trainer": "4095"}})


def test_a_child_spawned_under_its_set_runs_there_and_the_spawner_is_put_back() -> None:
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    stack = SimpleNamespace(config=SimpleNamespace(placement=PlacementSection(trainer=str(cpu))))
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with Supervisor._pinned(stack, "trainer"):
        child = subprocess.run(probe, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str([cpu])
    assert os.sched_getaffinity(0) == mine
    with Supervisor._pinned(stack, "gateway"):  # no set: untouched
        child = subprocess.run(probe, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(mine))


def test_with_no_set_given_the_engine_gets_half_the_cpus_and_the_rest_share_the_other_half(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 8})
    placement = UpConfig.model_validate({}).placement
    assert placement.sets() == {"engine": "4,5", "trainer": "6,7,8", "services": "6,7,8"}
    assert placement.engine is None  # the config as written: what it says, not the choice
    assert placement.cpus_for("engine-1") == {4, 5}
    assert placement.cpus_for("redis") == {6, 7, 8}
    assert "engine on CPU 4,5" in placement.describe()
    assert "placement.auto" in placement.describe()
    copied = UpConfig.model_validate(UpConfig.model_validate({}).model_dump()).model_copy()
    assert copied.placement.sets() == placement.sets()  # a config read back chooses the same

    given = UpConfig.model_validate({"placement": {"engine": "4"}}).placement
    assert given.sets() == {"engine": "4", "trainer": None, "services": None}
    assert "auto" not in given.describe()
    off = UpConfig.model_validate({"placement": {"auto": False}}).placement
    assert off.cpus_for("engine-0") is None and off.cpus_for("trainer") is None
    assert off.describe() == "placement: every part may use any CPU"

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    alone = UpConfig.model_validate({}).placement
    assert alone.cpus_for("engine-0") is None and alone.cpus_for("trainer") is None
