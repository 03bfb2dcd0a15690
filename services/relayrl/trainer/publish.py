"""Where a new policy version goes after a step: a publisher per backend, from one table.

Publishing is collective: every trainer rank calls `publish` (the TP gather of the export needs
all of them); only rank 0 writes. The weight-sync service (its own issue) plugs in here as one
more entry of `PUBLISHERS`.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relayrl.core.outage import Outage
from relayrl.trainer.config import (
    HfDirPublishConfig,
    NoPublishConfig,
    WeightSyncPublishConfig,
)

if TYPE_CHECKING:
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.runtime import PolicyModel
    from relayrl.weightsync.sender import WeightSyncSender


class WeightPublisher(ABC):
    @abstractmethod
    def publish(
        self, version: int, model: PolicyModel, spec: ModelSpec, *, supersede: bool = False
    ) -> dict[str, float]:
        """Makes `version` of `model` available to rollout; returns metrics (bytes, ...).
        `supersede`: the trainer resumed from a checkpoint, and rollout may hold a newer
        version than `version`, which these weights must replace."""

    def committed_version(self) -> int | None:
        """The version rollout holds now, where the backend knows it (None: it does not)."""
        return None

    def begin(self, version: int, model: PolicyModel, spec: ModelSpec) -> None:  # noqa: B027
        """Rollout holds `model` as `version` now (the loop has restored and republished it);
        called once before the first step, on every rank."""

    def finish(self, model: PolicyModel, spec: ModelSpec) -> None:  # noqa: B027
        """Training is over (or stopped): anything trained but not yet published goes out now,
        so what a run leaves in rollout is its last policy; on every rank."""

    def rollout_version(self, trained: int) -> int:
        """The newest version rollout has been sent, after `trained` versions were trained."""
        return trained


class NoPublisher(WeightPublisher):
    def __init__(self, settings: NoPublishConfig, hf_dir: Path, **_: Any) -> None:
        pass

    def publish(
        self, version: int, model: PolicyModel, spec: ModelSpec, *, supersede: bool = False
    ) -> dict[str, float]:
        return {}


class HfDirPublisher(WeightPublisher):
    """`<dir>/v<version>`: a complete HF folder (config, weights, tokenizer); `save_hf_dir`
    writes it under a temporary name and renames it, so a reader never sees half a version."""

    def __init__(self, settings: HfDirPublishConfig, hf_dir: Path, **_: Any) -> None:
        self._settings = settings
        self._source = hf_dir

    def path(self, version: int) -> Path:
        return self._settings.dir / f"v{version}"

    def publish(
        self, version: int, model: PolicyModel, spec: ModelSpec, *, supersede: bool = False
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
    holds the version.

    A publish that fails (weight-sync restarting, a transfer that did not commit) is tried
    again, with backoff, for up to `outage_timeout_s`: the ranks agree after each try (an
    all-reduce of their outcomes), so they all retry together -- a transfer needs every rank's
    buckets."""

    def __init__(
        self, settings: WeightSyncPublishConfig, hf_dir: Path, *, outage_timeout_s: float = 600
    ) -> None:
        self._settings = settings
        self._outage_timeout_s = outage_timeout_s
        self._sender: WeightSyncSender | None = None

    def _connect(self) -> WeightSyncSender:
        if self._sender is None:
            from relayrl.weightsync.sender import WeightSyncSender

            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            from relayrl.core.grpc_client import ClientIdentity

            self._sender = WeightSyncSender(
                self._settings.target,
                identity=ClientIdentity.from_config(self._settings, "publish"),
                rank=rank,
                world_size=world,
                quantization=self._settings.quantization,
                quantize_embeddings=self._settings.quantize_embeddings,
                timeout_s=self._settings.timeout_s,
                keepalive=self._settings.keepalive,
                delta=self._settings.delta,
            )
        return self._sender

    def _outage(self) -> Outage:
        return Outage(f"weight-sync at {self._settings.target}", self._outage_timeout_s)

    def committed_version(self) -> int | None:
        import grpc

        sender = self._connect()
        return self._outage().call(sender.committed_version, (grpc.RpcError,))

    def publish(
        self, version: int, model: PolicyModel, spec: ModelSpec, *, supersede: bool = False
    ) -> dict[str, float]:
        from relayrl.trainer.hf_mapping import export_hf_tensors

        tensors = list(export_hf_tensors(model, spec))  # collective: once, whatever the tries
        return self.publish_tensors(version, tensors, supersede=supersede)

    def publish_tensors(
        self, version: int, tensors: list[tuple[str, torch.Tensor]], *, supersede: bool = False
    ) -> dict[str, float]:
        """`publish` of an export already made (`export_hf_tensors`); on every rank."""
        import grpc

        from relayrl.weightsync.sender import PublishError

        sender = self._connect()
        outage = self._outage()
        while True:
            error: Exception | None = None
            try:
                result = sender.publish(version, version, tensors, supersede=supersede)
                if self._settings.wait_for_commit or supersede:
                    sender.wait_committed(result.transfer_id, self._settings.timeout_s)
            except (PublishError, grpc.RpcError) as exc:
                error = exc
            if _every_rank(error is None):
                outage.recovered()
                break
            outage.failed(error or "another trainer rank's publish failed")
        return {
            "publish_bytes": float(result.bytes_total),
            "publish_sent_bytes": float(result.bytes_sent),
            **{f"publish_{k}_s": v for k, v in result.seconds.items()},
        }


class LaggedPublisher(WeightPublisher):
    """RESEARCH ONLY (`research.policy_lag`, `make bench-staleness`,
    docs/staleness.md#controlled-lag): rollout samples from weights exactly `lag` versions
    behind the trainer.

    After training version v the trainer keeps a host copy of its export and publishes version
    v - lag, from the copy it made `lag` steps ago, under its own number. Weight-sync and the
    engines see versions only go forward and every trajectory is tagged with the version that
    really generated it, so the trainer's policy lag (step - launching version) is `lag` plus
    the mode's own. Rollout starts from the version it holds when the loop begins (the initial
    or a restored one) and stays on it for the first `lag` steps: the lag builds up from 0.
    At the end the last trained version is published, so the run leaves (and the final
    evaluation sees) the trained policy. Costs `lag + 1` host copies of the model's export."""

    def __init__(self, inner: WeightSyncPublisher, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"a lagged publisher needs lag >= 1 (got {lag})")
        self._inner = inner
        self._lag = lag
        self._held: dict[int, list[tuple[str, torch.Tensor]]] = {}  # version -> export
        self._published = 0

    @staticmethod
    def _export(model: PolicyModel, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
        from relayrl.trainer.hf_mapping import export_hf_tensors

        return [(name, tensor.cpu()) for name, tensor in export_hf_tensors(model, spec)]

    def committed_version(self) -> int | None:
        return self._inner.committed_version()

    def begin(self, version: int, model: PolicyModel, spec: ModelSpec) -> None:
        self._held = {version: self._export(model, spec)}
        self._published = version

    def publish(
        self, version: int, model: PolicyModel, spec: ModelSpec, *, supersede: bool = False
    ) -> dict[str, float]:
        if supersede:  # a resume: rollout gets the restored weights; `begin` follows
            return self._inner.publish(version, model, spec, supersede=True)
        self._held[version] = self._export(model, spec)
        return self._send(version - self._lag)

    def _send(self, version: int) -> dict[str, float]:
        if version <= self._published or version not in self._held:
            return {}
        published = self._inner.publish_tensors(version, self._held[version])
        self._published = version
        for old in [v for v in self._held if v < version]:
            del self._held[old]
        return published

    def finish(self, model: PolicyModel, spec: ModelSpec) -> None:
        if self._held:
            self._send(max(self._held))

    def rollout_version(self, trained: int) -> int:
        return self._published


def _every_rank(ok: bool) -> bool:
    """Whether `ok` holds on every trainer rank (collective when there are several)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


PUBLISHERS: dict[str, type[WeightPublisher]] = {
    "none": NoPublisher,
    "hf_dir": HfDirPublisher,
    "weightsync": WeightSyncPublisher,
}


def build_publisher(
    settings: NoPublishConfig | HfDirPublishConfig | WeightSyncPublishConfig,
    hf_dir: Path,
    *,
    outage_timeout_s: float = 600.0,
    lag: int = 0,
) -> WeightPublisher:
    """The publisher of `settings.type`; with `lag` (research only, weightsync only, checked
    by the trainer's config) wrapped so rollout stays that many versions behind."""
    publisher = PUBLISHERS[settings.type](  # type: ignore[arg-type]
        settings, hf_dir, outage_timeout_s=outage_timeout_s
    )
    if lag:
        assert isinstance(publisher, WeightSyncPublisher), "the config allows lag with weightsync"
        return LaggedPublisher(publisher, lag)
    return publisher
