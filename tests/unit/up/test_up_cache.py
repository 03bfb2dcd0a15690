"""The cache of `relayrl up`'s prepared artefacts (`relayrl.up.prepare._cached`): entries appear
whole, and two runs building one entry at once both get it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.up.prepare import _cached


def write(content: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        out.mkdir()
        (out / "weights").write_text(content)

    return build


def test_an_entry_is_built_once_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "model-1"
    assert _cached(path, write("first")) == path
    assert _cached(path, write("second")) == path
    assert (path / "weights").read_text() == "first"
    assert [p.name for p in path.parent.iterdir()] == ["model-1"]  # no scratch left


def test_a_run_that_finishes_second_keeps_the_entry_the_first_wrote(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "model-1"

    def build_while_another_run_finishes(out: Path) -> None:
        _cached(path, write("other run"))  # finishes while this build is under way
        write("this run")(out)

    assert _cached(path, build_while_another_run_finishes) == path
    assert (path / "weights").read_text() == "other run"
    assert [p.name for p in path.parent.iterdir()] == ["model-1"]


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "model-1"

    def fail(out: Path) -> None:
        out.mkdir()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        _cached(path, fail)
    assert list(path.parent.iterdir()) == []
