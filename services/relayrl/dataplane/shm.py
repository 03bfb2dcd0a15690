"""The shared-memory data plane's files: where weight-sync keeps a transfer's buckets when its
senders and engine workers share its host, so that the bytes are written once by the sender
and read once by each worker, with no gRPC stream, no copy into the service and no page
allocated per version.

Layout, under `data_plane.shm_dir` (a tmpfs, /dev/shm by default):

    relayrl-weightsync-<pid>-<token>/   mode 0700: only weight-sync's own user reaches it
        HOST                            the token; a sender or worker that reads the plan's
                                        token here shares the host (and this folder)
        slot-<n>/bucket-<index>.bin     one transfer's buckets, mode 0600

A slot holds one transfer at a time: the service gives each new transfer a free slot and takes
it back when the transfer's buckets are dropped (a newer version committed, or the transfer
failed). Slots are reused, not removed: on this machine the first touch of fresh memory costs
more than the copy itself (about 0.4 s per 270 MB against 0.03 s), so a sender that overwrites
the files of two versions ago writes into pages that already exist. The price is up to two
versions of the model in tmpfs while the service runs; the folder goes with the service, and a
service that was killed has its folder removed by the next one started on the host.

A bucket's integrity does not rest on the files: the sender states each bucket's sha256, the
service checks it when the sender hands the bucket over, and every worker checks it again
after reading, so a file overwritten at the wrong moment fails a load instead of loading.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
from collections import deque
from pathlib import Path

PREFIX = "relayrl-weightsync-"
HOST_FILE = "HOST"


def bucket_path(slot: str | Path, index: int) -> Path:
    return Path(slot) / f"bucket-{index}.bin"


def shares_host(slot: str, token: str) -> bool:
    """Whether this process sees the service's shared-memory folder that holds `slot` (the
    plan's shm_dir and shm_token): the same host, and the same filesystem view."""
    if not slot or not token:
        return False
    try:
        return (Path(slot).parent / HOST_FILE).read_text() == token
    except OSError:
        return False


def write_bucket(slot: str | Path, index: int, data: memoryview) -> None:
    """Sender side: bucket `index` into its file in `slot`, over the pages a previous transfer
    of this slot left there (the file keeps its pages; only a new size truncates it)."""
    fd = os.open(bucket_path(slot, index), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size != len(data):
            os.ftruncate(fd, len(data))
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
    finally:
        os.close(fd)


def read_bucket(slot: str | Path, index: int, out: memoryview) -> None:
    """Worker side: bucket `index` into `out`, which has exactly the plan's size for it
    (OSError when the file is shorter or longer)."""
    with open(bucket_path(slot, index), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != len(out):
            raise OSError(f"{f.name} holds {size} bytes, the plan says {len(out)}")
        filled = 0
        while filled < len(out):
            n = f.readinto(out[filled:])
            if not n:
                raise OSError(f"{f.name} ended after {filled} bytes")
            filled += n


def map_bucket(slot: str | Path, index: int, size: int) -> mmap.mmap | bytes:
    """Service side: bucket `index` of `slot`, mapped read-only (PlanMismatch-worthy sizes
    are the caller's to check: OSError when the file does not have `size` bytes)."""
    path = bucket_path(slot, index)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise OSError(f"{path} holds {actual} bytes, the plan says {size}")
        if size == 0:
            return b""
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmArea:
    """weight-sync's folder of slots under `parent` (created at start, removed by `close`)."""

    def __init__(self, parent: Path) -> None:
        if not parent.is_dir():
            raise OSError(f"data_plane.shm_dir {parent} is not a folder (a tmpfs such as /dev/shm)")
        self._remove_stale(parent)
        self.token = secrets.token_hex(16)
        self.root = parent / f"{PREFIX}{os.getpid()}-{self.token[:8]}"
        self.root.mkdir(mode=0o700)
        host = os.open(self.root / HOST_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(host, "w") as f:
            f.write(self.token)
        self._free: deque[Path] = deque()
        self._count = 0

    @staticmethod
    def _remove_stale(parent: Path) -> None:
        """Folders of weight-sync processes of this user that died without removing theirs."""
        for path in parent.glob(f"{PREFIX}*"):
            pid = path.name[len(PREFIX) :].split("-", 1)[0]
            with contextlib.suppress(OSError):
                if pid.isdigit() and path.stat().st_uid == os.getuid() and not _alive(int(pid)):
                    shutil.rmtree(path, ignore_errors=True)

    def acquire(self) -> Path:
        """A slot for a new transfer: the one freed longest ago, or a new one."""
        if self._free:
            return self._free.popleft()
        slot = self.root / f"slot-{self._count}"
        self._count += 1
        slot.mkdir(mode=0o700)
        return slot

    def release(self, slot: Path) -> None:
        self._free.append(slot)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
