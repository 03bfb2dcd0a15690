"""The committed version on disk, so that a restarted weight-sync still holds it.

Late joiners (a new or restarted engine) are brought to the committed version from
weight-sync's host copy, without the trainer. That copy used to live only in memory, so a
restarted weight-sync had nothing to give them and no way to tell which engines held the
committed weights. `CommittedStore` writes every committed version to `state_dir` before the
commit is announced, and reads it back at start-up, each bucket checked against its sha256.

Layout of `state_dir`:

    committed.json             which version is committed: version, transfer id, the folder,
                               the plan digest and every bucket's sha256
    v<version>-<transfer id>/  plan.pb (the BucketPlan), tensors.pb (the senders' manifest as
                               a PublishRequest), bucket-<index>.bin

A version is written into `.<folder>.partial`, fsynced, renamed into place, and only then
named by `committed.json` (itself written to a scratch file and renamed), so a crash at any
point leaves the previous committed version intact. Older folders are removed afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.core.atomic import atomic_write_bytes, fsync_dir
from relayrl.dataplane.plan import BucketLayout, Piece, layouts_from_pieces, plan_digest
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

logger = logging.getLogger(__name__)

POINTER = "committed.json"
FORMAT = 1


class StateError(ValueError):
    """`state_dir` holds a committed version that cannot be used; the message says what to do."""


@dataclass
class StoredVersion:
    """A committed version as read back from disk (every bucket's checksum verified)."""

    version: int
    trainer_step: int
    transfer_id: str
    metas: list[common_pb2.TensorMeta]
    layouts: list[BucketLayout]
    plan_digest: str
    buckets: list[bytes]
    sha256: list[str]
    committed_at: float


def _write(path: Path, data: bytes | mmap.mmap) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CommittedStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def stage(
        self,
        *,
        version: int,
        trainer_step: int,
        transfer_id: str,
        metas: list[common_pb2.TensorMeta],
        plan: pb.BucketPlan,
        buckets: Sequence[bytes | mmap.mmap],
    ) -> str:
        """Writes `version` into its own folder, synced to disk, without making it the
        committed one (`point` does; `discard` removes a folder that will not be); the
        folder's name. OSError on a disk problem."""
        self.directory.mkdir(parents=True, exist_ok=True)
        folder = f"v{version}-{transfer_id}"
        partial = self.directory / f".{folder}.partial"
        final = self.directory / folder
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _write(partial / "plan.pb", plan.SerializeToString())
        manifest = pb.PublishRequest(version=version, trainer_step=trainer_step, tensors=metas)
        _write(partial / "tensors.pb", manifest.SerializeToString())
        for index, data in enumerate(buckets):
            _write(partial / f"bucket-{index:05d}.bin", data)
        fsync_dir(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return folder

    def point(
        self,
        *,
        version: int,
        trainer_step: int,
        transfer_id: str,
        folder: str,
        plan: pb.BucketPlan,
        sha256: list[str],
    ) -> None:
        """Makes the staged `folder` the committed version (atomic), then removes the others."""
        pointer = {
            "format": FORMAT,
            "version": version,
            "trainer_step": trainer_step,
            "transfer_id": transfer_id,
            "folder": folder,
            "plan_digest": plan_digest(_layouts(plan)),
            "sha256": sha256,
            "committed_at": time.time(),
        }
        atomic_write_bytes(
            self.directory / POINTER, json.dumps(pointer, indent=1).encode(), fsync=True
        )
        for old in self.directory.iterdir():
            if old.is_dir() and old.name != folder:
                shutil.rmtree(old, ignore_errors=True)

    def discard(self, folder: str) -> None:
        """Removes a staged folder that was not committed (its load failed); never the one
        the pointer names (a `point` that failed after replacing it)."""
        try:
            named = json.loads((self.directory / POINTER).read_text()).get("folder")
        except (OSError, ValueError, AttributeError):
            named = None
        if named != folder:
            shutil.rmtree(self.directory / folder, ignore_errors=True)

    def load(self) -> StoredVersion | None:
        """The committed version on disk, or None when nothing was ever committed here.
        StateError when it is there but unusable (a missing file, a checksum mismatch)."""
        pointer_path = self.directory / POINTER
        if not pointer_path.exists():
            return None
        where = f"weight-sync state {self.directory}"
        fix = f"move {self.directory} away to start with nothing committed"
        try:
            pointer = json.loads(pointer_path.read_text())
            if pointer.get("format") != FORMAT:
                raise StateError(f"{where}: format {pointer.get('format')!r}, expected {FORMAT}")
            folder = self.directory / pointer["folder"]
            plan = pb.BucketPlan.FromString((folder / "plan.pb").read_bytes())
            manifest = pb.PublishRequest.FromString((folder / "tensors.pb").read_bytes())
            layouts = _layouts(plan)
            buckets = [(folder / f"bucket-{i:05d}.bin").read_bytes() for i in range(len(layouts))]
        except StateError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{where} is unreadable ({exc}); {fix}") from None
        sha256 = list(pointer["sha256"])
        if len(sha256) != len(buckets):
            raise StateError(f"{where}: {len(buckets)} buckets but {len(sha256)} checksums; {fix}")
        for index, (data, expected) in enumerate(zip(buckets, sha256, strict=True)):
            if hashlib.sha256(data).hexdigest() != expected:
                raise StateError(f"{where}: bucket {index} fails its checksum; {fix}")
        if plan_digest(layouts) != pointer["plan_digest"]:
            raise StateError(f"{where}: the plan does not match its digest; {fix}")
        logger.info(
            "committed version %d (%s) read back from %s",
            pointer["version"],
            pointer["transfer_id"],
            self.directory,
        )
        return StoredVersion(
            version=int(pointer["version"]),
            trainer_step=int(pointer["trainer_step"]),
            transfer_id=str(pointer["transfer_id"]),
            metas=list(manifest.tensors),
            layouts=layouts,
            plan_digest=str(pointer["plan_digest"]),
            buckets=buckets,
            sha256=sha256,
            committed_at=float(pointer.get("committed_at", 0.0)),
        )


def _layouts(plan: pb.BucketPlan) -> list[BucketLayout]:
    return layouts_from_pieces(
        [Piece.from_proto(meta) for bucket in plan.buckets for meta in bucket.tensors]
    )
