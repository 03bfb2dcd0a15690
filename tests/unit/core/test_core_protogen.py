"""Generated protobuf code cannot be stale, and v1 contracts only grow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relayrl.core import protogen


def test_stale_or_missing_generated_code_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(protogen.PROTO_ROOT, root)
    stamp = tmp_path / "GENERATED_FROM"
    with pytest.raises(protogen.StaleProtosError, match="missing: run `make protos`"):
        protogen.verify(root, stamp)
    stamp.write_text(protogen.sources_digest(root) + "\n")
    protogen.verify(root, stamp)
    reward = root / "relayrl/proto/reward/v1/reward.proto"
    reward.write_text(reward.read_text() + "\nmessage Added {}\n")
    with pytest.raises(protogen.StaleProtosError, match="older than protos/"):
        protogen.verify(root, stamp)


def test_an_installed_package_without_sources_is_not_checked(tmp_path: Path) -> None:
    protogen.verify(tmp_path / "no-protos-here", tmp_path / "no-stamp")


def test_this_checkout_is_generated_from_its_sources() -> None:
    protogen.verify()


RELEASED = {
    "messages": {"p.A": {"x": [1, 5, 1, ""], "y": [2, 11, 3, ".p.B"]}},
    "enums": {"p.E": {"E_UNSPECIFIED": [0], "E_ONE": [1]}},
    "rpcs": {"p.S": {"Get": [".p.A", ".p.A", False, False]}},
}


def _changed(**edits: object) -> dict:
    current = json.loads(json.dumps(RELEASED))
    for path, value in edits.items():
        kind, owner, member = path.split("__")
        owner = owner.replace("_", ".")
        if value is None:
            del current[kind][owner][member]
        else:
            current[kind][owner][member] = value
    return current


def test_additions_are_compatible() -> None:
    current = _changed(messages__p_A__z=[3, 9, 1, ""], enums__p_E__E_TWO=[2])
    current["rpcs"]["p.T"] = {"New": [".p.A", ".p.A", True, True]}
    assert protogen.breaking_changes(RELEASED, current) == []


@pytest.mark.parametrize(
    ("edits", "problem"),
    [
        ({"messages__p_A__x": None}, "p.A.x was removed"),
        ({"messages__p_A__x": [7, 5, 1, ""]}, "p.A.x changed"),
        ({"messages__p_A__y": [2, 11, 3, ".p.C"]}, "p.A.y changed"),
        ({"enums__p_E__E_ONE": [5]}, "p.E.E_ONE changed"),
        ({"rpcs__p_S__Get": [".p.A", ".p.A", False, True]}, "p.S.Get changed"),
    ],
)
def test_breaking_changes_are_named(edits: dict, problem: str) -> None:
    problems = protogen.breaking_changes(RELEASED, _changed(**edits))
    assert len(problems) == 1 and problem in problems[0]


def test_removed_service_is_breaking() -> None:
    current = _changed()
    del current["rpcs"]["p.S"]
    assert protogen.breaking_changes(RELEASED, current) == ["rpc p.S was removed"]


def test_the_protos_only_grew_since_the_recorded_contract() -> None:
    released = json.loads(protogen.CONTRACT.read_text())
    assert protogen.breaking_changes(released, protogen.describe_contract()) == []
