"""`relayrl.core.atomic`: a file is replaced whole or not at all, the scratch file never stays
behind (not even when the writer raises), a private file is private from its creation, and
only a durable write pays for fsync."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Literal

import pytest

from relayrl.core import atomic
from relayrl.core.atomic import atomic_open, atomic_write_bytes, atomic_write_text


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_write_replaces_the_file_whole_and_leaves_no_scratch(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_text(path, '{"a": 1}')
    assert path.read_text(encoding="utf-8") == '{"a": 1}'
    atomic_write_text(path, "é\n")
    assert path.read_bytes() == "é\n".encode()
    atomic_write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    with atomic_open(path, "w") as out:
        out.write("one\n")
        out.write("two\n")
    assert path.read_text() == "one\ntwo\n"
    assert names(tmp_path) == ["state.json"]


@pytest.mark.parametrize("mode", ["w", "wb"])
def test_a_writer_that_raises_leaves_the_old_file_and_no_partial_one(
    tmp_path: Path, mode: Literal["w", "wb"]
) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="half way"), atomic_open(path, mode) as out:
        out.write("new" if mode == "w" else b"new")
        out.flush()
        raise RuntimeError("half way")
    assert path.read_text() == "old\n"
    assert names(tmp_path) == ["records.jsonl"]
    with pytest.raises(RuntimeError), atomic_open(tmp_path / "never.txt") as out:
        raise RuntimeError
    assert names(tmp_path) == ["records.jsonl"]


def test_permissions_are_those_of_write_text_unless_private(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "public", "x")
        atomic_write_text(tmp_path / "private", "x", permissions=0o600)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "public").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600


def test_only_a_durable_write_syncs_the_file_and_then_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    atomic_write_bytes(tmp_path / "fast", b"x")
    assert synced == []
    atomic_write_bytes(tmp_path / "durable", b"x", fsync=True)
    assert synced == ["file", "dir"]


def test_writers_of_one_file_at_once_never_share_a_scratch_file(tmp_path: Path) -> None:
    path = tmp_path / "units.json"
    contents = [str(n) * 10_000 for n in range(8)]

    def write(content: str) -> None:
        for _ in range(20):
            atomic_write_text(path, content)

    threads = [threading.Thread(target=write, args=(c,)) for c in contents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_text() in contents
    assert names(tmp_path) == ["units.json"]
