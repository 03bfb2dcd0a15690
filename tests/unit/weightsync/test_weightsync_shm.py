"""The shared-memory data plane's files (relayrl.dataplane.shm): the service's private folder
and host token, slots reused in the order they were freed, buckets written over the pages a
previous transfer left, read back only at the plan's size, and the folders of dead services
removed by the next one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.dataplane.shm import (
    HOST_FILE,
    PREFIX,
    ShmArea,
    bucket_path,
    map_bucket,
    read_bucket,
    shares_host,
    write_bucket,
)


def test_the_folder_is_private_and_its_token_tells_who_shares_the_host(tmp_path: Path) -> None:
    area = ShmArea(tmp_path)
    assert area.root.parent == tmp_path and area.root.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert area.root.stat().st_mode & 0o777 == 0o700
    assert (area.root / HOST_FILE).stat().st_mode & 0o777 == 0o600
    slot = area.acquire()
    assert shares_host(str(slot), area.token)
    assert not shares_host(str(slot), "f" * 32)
    assert not shares_host(str(tmp_path / "elsewhere" / "slot-0"), area.token)
    assert not shares_host("", area.token) and not shares_host(str(slot), "")
    area.close()
    assert not area.root.exists()
    assert not shares_host(str(slot), area.token)


def test_slots_are_reused_in_the_order_they_were_freed(tmp_path: Path) -> None:
    area = ShmArea(tmp_path)
    first, second, third = area.acquire(), area.acquire(), area.acquire()
    assert [p.name for p in (first, second, third)] == ["slot-0", "slot-1", "slot-2"]
    area.release(second)
    area.release(first)
    assert area.acquire() == second and area.acquire() == first
    assert area.acquire().name == "slot-3"


def test_a_bucket_is_written_over_the_old_file_and_read_back_at_the_plans_size(
    tmp_path: Path,
) -> None:
    slot = ShmArea(tmp_path).acquire()
    write_bucket(slot, 0, memoryview(b"a" * 4096))
    inode = bucket_path(slot, 0).stat().st_ino
    write_bucket(slot, 0, memoryview(b"b" * 1000))  # a smaller bucket in the same file
    assert bucket_path(slot, 0).stat().st_ino == inode
    assert bucket_path(slot, 0).read_bytes() == b"b" * 1000
    out = bytearray(1000)
    read_bucket(slot, 0, memoryview(out))
    assert out == b"b" * 1000
    with pytest.raises(OSError, match="holds 1000 bytes, the plan says 999"):
        read_bucket(slot, 0, memoryview(bytearray(999)))
    with pytest.raises(OSError):
        read_bucket(slot, 1, memoryview(bytearray(10)))
    mapped = map_bucket(slot, 0, 1000)
    assert bytes(mapped) == b"b" * 1000
    with pytest.raises(OSError, match="the plan says 4096"):
        map_bucket(slot, 0, 4096)


def test_the_folders_of_dead_services_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f"{PREFIX}{dead.stdout.strip()}-0badc0de"
    (stale / "slot-0").mkdir(parents=True)
    (stale / "slot-0" / "bucket-0.bin").write_bytes(b"x" * 100)
    live = ShmArea(tmp_path)
    unrelated = tmp_path / "someone-else"
    unrelated.mkdir()
    ShmArea(tmp_path)
    assert not stale.exists()
    assert live.root.exists() and unrelated.exists()


def test_a_parent_that_is_not_a_folder_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"shm_dir .* is not a folder"):
        ShmArea(tmp_path / "missing")
