"""Where a new policy version goes after a step: a publisher per backend, from one table.

Publishing is collective: every trainer rank calls `publish` (the TP gather of the export needs
all of them); only rank 0 writes. The weight-sync service (its own issue) plugs in here as one
more entry of `PUBLISHERS`.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch.distributed as dist

from relayrl.trainer.config import (
    HfDirPublishSettings,
    NoPublishSettings,
    WeightSyncPublishSettings,
)


class WeightPublisher(ABC):
    @abstractmethod
    def publish(
        self, version: int, model: Any, spec: Any, *, supersede: bool = False
    ) -> dict[str, float]:
        """Makes `version` of `model` available to rollout; returns metrics (bytes, ...).
        `supersede`: the trainer resumed from a checkpoint, and rollout may hold a newer
        version than `version`, which these weights must replace."""


class NoPublisher(WeightPublisher):
    def __init__(self, settings: NoPublishSettings, hf_dir: Path) -> None:
        pass

    def publish(
        self, version: int, model: Any, spec: Any, *, supersede: bool = False
    ) -> dict[str, float]:
        return {}


class HfDirPublisher(WeightPublisher):
    """`<dir>/v<version>`: a complete HF folder (config, weights, tokenizer); `save_hf_dir`
    writes it under a temporary name and renames it, so a reader never sees half a version."""

    def __init__(self, settings: HfDirPublishSettings, hf_dir: Path) -> None:
        self._settings = settings
        self._source = hf_dir

    def path(self, version: int) -> Path:
        return self._settings.dir / f"v{version}"

    def publish(
        self, version: int, model: Any, spec: Any, *, supersede: bool = False
    ) -> dict[str, float]:
        from relayrl.trainer.model import save_hf_dir

        final = self.path(version)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0 and final.exists():  # left by a run that crashed before its checkpoint
            shutil.rmtree(final)
        written = save_hf_dir(model, spec, final, tokenizer_from=self._source)
        if written is None:
            return {}
        self._prune(version)
        size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
        return {"publish_bytes": float(size)}

    def _prune(self, version: int) -> None:
        versions = sorted(
            int(p.name[1:])
            for p in self._settings.dir.glob("v*")
            if p.is_dir() and p.name[1:].isdigit()
        )
        for old in versions[: -self._settings.keep]:
            if old != version:
                shutil.rmtree(self.path(old), ignore_errors=True)


class WeightSyncPublisher(WeightPublisher):
    """Every rank exports the full (TP-gathered) HF tensors and pushes its share of the
    buckets to relayrl-weightsync; with wait_for_commit the step ends once every live replica
    holds the version."""

    def __init__(self, settings: WeightSyncPublishSettings, hf_dir: Path) -> None:
        self._settings = settings
        self._sender: Any = None

    def _connect(self) -> Any:
        if self._sender is None:
            from relayrl.weightsync.sender import WeightSyncSender

            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            self._sender = WeightSyncSender(
                self._settings.target,
                rank=rank,
                world_size=world,
                quantization=self._settings.quantization,
                quantize_embeddings=self._settings.quantize_embeddings,
                timeout_s=self._settings.timeout_s,
            )
        return self._sender

    def publish(
        self, version: int, model: Any, spec: Any, *, supersede: bool = False
    ) -> dict[str, float]:
        from relayrl.trainer.hf_mapping import export_hf_tensors

        sender = self._connect()
        tensors = list(export_hf_tensors(model, spec))
        result = sender.publish(version, version, tensors, supersede=supersede)
        if self._settings.wait_for_commit or supersede:
            sender.wait_committed(result.transfer_id, self._settings.timeout_s)
        return {
            "publish_bytes": float(result.bytes_total),
            "publish_sent_bytes": float(result.bytes_sent),
            **{f"publish_{k}_s": v for k, v in result.seconds.items()},
        }


PUBLISHERS: dict[str, type[WeightPublisher]] = {
    "none": NoPublisher,
    "hf_dir": HfDirPublisher,
    "weightsync": WeightSyncPublisher,
}


def build_publisher(
    settings: NoPublishSettings | HfDirPublishSettings | WeightSyncPublishSettings, hf_dir: Path
) -> WeightPublisher:
    return PUBLISHERS[settings.type](settings, hf_dir)  # type: ignore[arg-type]
