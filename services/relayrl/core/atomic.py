"""Replacing a file whole: write to a scratch file beside it, then rename it into place, so a
reader (or a restart after a crash) sees the old content or the new, never half of it.

The scratch file is `.<name>.<random>.tmp` in the same folder (a rename does not cross file
systems), created exclusively, so writers of the same file at once (threads, processes) never
share one; it is removed when the write fails. `fsync=True` also syncs the file before the
rename and the folder after it, for state that must survive a power loss (weight-sync's
committed version); without it the replacement is atomic but not durable, and costs no sync.

A whole folder written then renamed (checkpoints, model folders, weight-sync's staged version)
is a different pattern, kept by each of those writers: they build many files, some on every
rank, and differ in what an existing target means.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

# What a file created by `Path.write_text` gets (less the umask).
DEFAULT_PERMISSIONS = 0o666


def fsync_dir(path: Path) -> None:
    """Syncs a folder's entries (a rename in it, a file created in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(
    path: Path,
    mode: Literal["w", "wb"] = "w",
    *,
    fsync: bool = False,
    permissions: int = DEFAULT_PERMISSIONS,
    encoding: str = "utf-8",
) -> Iterator[IO[Any]]:
    """A file to write `path`'s new content into (text for "w", bytes for "wb"); it replaces
    `path` when the block ends, and nothing does when the block raises. `permissions`: the
    mode of a new file before the umask (0o600: only its owner may read it)."""
    path = Path(path)
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, permissions)
    try:
        if mode == "wb":
            with os.fdopen(fd, "wb") as binary:
                yield binary
                _sync(binary, fsync)
        else:
            with os.fdopen(fd, "w", encoding=encoding) as text:
                yield text
                _sync(text, fsync)
        os.replace(scratch, path)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def _sync(file: IO[Any], fsync: bool) -> None:
    if fsync:
        file.flush()
        os.fsync(file.fileno())


def atomic_write_bytes(
    path: Path,
    data: bytes | bytearray | memoryview,
    *,
    fsync: bool = False,
    permissions: int = DEFAULT_PERMISSIONS,
) -> None:
    """Replaces `path` with `data`, whole (see `atomic_open`)."""
    with atomic_open(path, "wb", fsync=fsync, permissions=permissions) as f:
        f.write(data)


def atomic_write_text(
    path: Path,
    text: str,
    *,
    fsync: bool = False,
    permissions: int = DEFAULT_PERMISSIONS,
    encoding: str = "utf-8",
) -> None:
    """Replaces `path` with `text`, whole (see `atomic_open`)."""
    with atomic_open(path, "w", fsync=fsync, permissions=permissions, encoding=encoding) as f:
        f.write(text)
