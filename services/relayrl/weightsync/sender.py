"""The sending end of a version, inside every trainer rank.

Boundary 1 (export): the trainer's HF-named tensors are cast to bf16, or quantised to FP8 e4m3
with scales (2-D linear weights only; the scale is listed before its weight so a receiver
never waits for it). Every rank exports the same full tensors (TP-gathered) and calls
`publish`; the service gives all of them one plan, and each rank pushes only its share of the
buckets (bucket i from rank i % world_size), packing the next bucket while the current one is
on the wire.

When the service keeps its buckets in shared memory (data plane shm) and this rank shares its
host, the rank writes each bucket into the file the plan names and pushes only its sha256: no
bytes go over gRPC, and no deltas are made (writing the full bucket costs less than
comparing it with the last one).

With `delta`, a rank keeps the bytes of the buckets it pushed last and sends each bucket as a
delta of them when the service accepted that version as the base (it must still be the
committed one, with the same plan) and the delta is smaller (relayrl.dataplane.delta). Anything
else (the first publish, `supersede`, a failed or superseded version, another plan) sends the
bucket in full. The kept bytes are this rank's share of the model.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from relayrl.dataplane.plan import DoubleBufferedPacker, layouts_from_plan, plan_digest
from relayrl.dataplane.shm import shares_host, write_bucket
from relayrl.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from relayrl.core.config import GrpcKeepaliveConfig
    from relayrl.core.grpc_client import ClientIdentity

Quantization = Literal["none", "fp8_per_tensor", "fp8_block_128"]

COMMIT_WAIT_S = 30.0
"""Longest one GetBucketPlan call waits for the commit (the service holds it)."""
COMMIT_POLL_S = 0.05
"""Poll interval against a service that answers at once (one without wait_for_final_s)."""

_DTYPES = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.float8_e4m3fn: common_pb2.DTYPE_FLOAT8_E4M3,
}
_QUANT = {
    "fp8_per_tensor": ("per_tensor", common_pb2.QUANTIZATION_FP8_PER_TENSOR),
    "fp8_block_128": ("block_128", common_pb2.QUANTIZATION_FP8_BLOCK_128),
}


class PublishError(RuntimeError):
    """A version could not be published or committed; the message names the boundary."""


@dataclass
class _DeltaBase:
    """This rank's buckets of the last version it pushed, by index."""

    transfer_id: str
    plan_digest: str
    buckets: dict[int, bytes]


@dataclass
class SendResult:
    transfer_id: str
    version: int
    num_buckets_sent: int = 0
    bytes_sent: int = 0
    bytes_total: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def export_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    quantization: Quantization,
    *,
    quantize_embeddings: bool = False,
) -> tuple[dict[str, torch.Tensor], list[common_pb2.TensorMeta]]:
    """Boundary 1: the tensors as they go on the wire, and their manifest (with FP8,
    `quantize_embeddings` quantises embeddings and lm_head too; see `relayrl.dataplane.quant`)."""
    from relayrl.dataplane.quant import quantize_fp8, scale_name, should_quantize

    out: dict[str, torch.Tensor] = {}
    metas: list[common_pb2.TensorMeta] = []

    def add(name: str, t: torch.Tensor, quant: int, scale: str = "") -> None:
        t = t.detach().to("cpu").contiguous()
        out[name] = t
        metas.append(
            common_pb2.TensorMeta(
                name=name,
                shape=list(t.shape),
                dtype=_DTYPES[t.dtype],
                quantization=quant,
                scale_name=scale,
            )
        )

    for name, tensor in tensors:
        if quantization != "none" and should_quantize(name, tensor, embeddings=quantize_embeddings):
            mode, quant = _QUANT[quantization]
            q, scale = quantize_fp8(tensor, mode)
            add(scale_name(name, mode), scale.float(), common_pb2.QUANTIZATION_NONE)
            add(name, q, quant, scale_name(name, mode))
        else:
            add(name, tensor.to(torch.bfloat16), common_pb2.QUANTIZATION_NONE)
    return out, metas


class WeightSyncSender:
    def __init__(
        self,
        target: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        quantization: Quantization = "none",
        quantize_embeddings: bool = False,
        timeout_s: float = 600.0,
        chunk_bytes: int = 4 * 1024 * 1024,
        identity: ClientIdentity | None = None,
        keepalive: GrpcKeepaliveConfig | None = None,
        delta: bool = False,
    ) -> None:
        """`identity`: the trainer's TLS and token towards weight-sync (none: plaintext,
        anonymous); `keepalive`: how a silent weight-sync is noticed within a long call (the
        default GrpcKeepaliveConfig when None); `delta`: send buckets as deltas of the last
        version where the service allows it."""
        from relayrl.core.grpc_client import ClientIdentity, channel_options, sync_channel
        from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self._rank, self._world_size = rank, world_size
        self._quantization = quantization
        self._quantize_embeddings = quantize_embeddings
        self._timeout_s = timeout_s
        self._chunk_bytes = chunk_bytes
        self._delta = delta
        self._base: _DeltaBase | None = None
        self._shm_error = ""
        self._channel = sync_channel(
            target,
            identity or ClientIdentity(),
            channel_options(max_message_bytes=256 * 1024 * 1024, keepalive=keepalive),
        )
        self._stub = weightsync_pb2_grpc.WeightSyncStub(self._channel)

    def publish(
        self,
        version: int,
        trainer_step: int,
        tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        supersede: bool = False,
    ) -> SendResult:
        """Export `tensors` as `version` and push this rank's share of the buckets; with
        `supersede` the version replaces a newer committed one (a trainer that resumed)."""
        import grpc

        from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

        clock = time.perf_counter()
        wire, metas = export_tensors(
            tensors, self._quantization, quantize_embeddings=self._quantize_embeddings
        )
        export_s = time.perf_counter() - clock
        base, self._base = self._base, None  # kept again only once this push went through
        if supersede:
            base = None
        try:
            plan = self._stub.Publish(
                pb.PublishRequest(
                    version=version,
                    trainer_step=trainer_step,
                    tensors=metas,
                    transport=pb.TRANSPORT_TYPE_GRPC,
                    supersede=supersede,
                    base_transfer_id=base.transfer_id if base is not None else "",
                ),
                timeout=self._timeout_s,
            ).plan
        except grpc.RpcError as exc:
            raise PublishError(f"export: Publish of version {version}: {exc.details()}") from None
        layouts = layouts_from_plan(plan)
        digest = plan_digest(layouts)
        shm_slot = plan.shm_dir if shares_host(plan.shm_dir, plan.shm_token) else ""
        if shm_slot:
            base = None
        if base is not None and (
            plan.delta_base_transfer_id != base.transfer_id or base.plan_digest != digest
        ):
            base = None  # refused (no longer the committed version, another plan): all in full
        result = SendResult(
            plan.transfer_id, version, bytes_total=sum(b.size_bytes for b in layouts)
        )
        result.seconds["export"] = export_s
        mine = [b.index for b in layouts if b.index % self._world_size == self._rank]
        pushed: dict[int, bytes] = {}
        self._shm_error = ""
        clock = time.perf_counter()
        try:
            response = self._stub.PushBuckets(
                self._chunks(plan.transfer_id, layouts, wire, mine, base, pushed, shm_slot),
                timeout=self._timeout_s,
            )
        except grpc.RpcError as exc:
            raise PublishError(
                f"transport: pushing {plan.transfer_id}: {exc.code().name}: {exc.details()}"
            ) from None
        if self._shm_error:
            raise PublishError(f"transport: {self._shm_error}")
        result.seconds["push"] = time.perf_counter() - clock
        result.num_buckets_sent, result.bytes_sent = response.num_buckets, response.num_bytes
        if self._delta and not shm_slot:
            self._base = _DeltaBase(plan.transfer_id, digest, pushed)
        return result

    def _chunks(
        self,
        transfer_id: str,
        layouts: list,
        wire: dict[str, torch.Tensor],
        mine: list[int],
        base: _DeltaBase | None,
        pushed: dict[int, bytes],
        shm_slot: str = "",
    ) -> Iterator:
        """This rank's buckets as chunks (each a delta of `base`'s where that is smaller; or,
        with `shm_slot`, written there and pushed as one empty chunk); the next bucket is
        packed while one is sent. Keeps each bucket's bytes in `pushed` when deltas are on."""
        from relayrl.dataplane import delta
        from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

        own = [layouts[i] for i in mine]
        size = max((b.size_bytes for b in own), default=1)
        with DoubleBufferedPacker(own, wire, size) as packer:
            for position, view, digest in packer:
                index = own[position].index
                if shm_slot:
                    try:
                        write_bucket(shm_slot, index, memoryview(view.numpy()))
                    except OSError as exc:  # ends the stream; publish raises it
                        self._shm_error = f"writing bucket {index} into {shm_slot}: {exc}"
                        return
                    packer.release(position)
                    yield pb.BucketChunk(
                        transfer_id=transfer_id,
                        bucket_index=index,
                        last=True,
                        bucket_sha256=digest,
                        shm=True,
                    )
                    continue
                data = view.numpy().tobytes()
                packer.release(position)
                if self._delta:
                    pushed[index] = data
                previous = base.buckets.get(index) if base is not None else None
                encoded = delta.encode(previous, data) if previous is not None else None
                if encoded is not None:
                    data = encoded
                for offset in range(0, max(len(data), 1), self._chunk_bytes):
                    last = offset + self._chunk_bytes >= len(data)
                    yield pb.BucketChunk(
                        transfer_id=transfer_id,
                        bucket_index=index,
                        offset_bytes=offset,
                        data=data[offset : offset + self._chunk_bytes],
                        last=last,
                        bucket_sha256=digest if last else "",
                        delta=encoded is not None,
                    )

    def wait_committed(self, transfer_id: str, timeout_s: float | None = None) -> None:
        """Blocks until the version is committed on every live replica; PublishError when the
        transfer failed (the message names the boundary) or the deadline passed."""
        from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

        deadline = time.monotonic() + (timeout_s or self._timeout_s)
        while True:
            # The service holds the call until the outcome (no polling interval added to
            # every step); a call at most COMMIT_WAIT_S long keeps each one well inside its
            # deadline.
            wait_s = max(0.0, min(COMMIT_WAIT_S, deadline - time.monotonic()))
            called = time.monotonic()
            plan = self._stub.GetBucketPlan(
                pb.GetBucketPlanRequest(transfer_id=transfer_id, wait_for_final_s=wait_s),
                timeout=wait_s + self._timeout_s,
            )
            if plan.state == pb.TRANSFER_STATE_COMMITTED:
                return
            if plan.state == pb.TRANSFER_STATE_FAILED:
                raise PublishError(f"{transfer_id} failed at {plan.error}")
            if time.monotonic() > deadline:
                raise PublishError(f"{transfer_id} was not committed in time")
            if time.monotonic() - called < min(wait_s, COMMIT_POLL_S):
                time.sleep(COMMIT_POLL_S)  # a service older than wait_for_final_s: poll

    def committed_version(self) -> int:
        """The version weight-sync has committed (0: none yet); grpc.RpcError when it does
        not answer."""
        from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

        reply = self._stub.GetVersion(pb.GetVersionRequest(), timeout=min(self._timeout_s, 30))
        return int(reply.committed.version)

    def close(self) -> None:
        self._channel.close()


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = ["PublishError", "SendResult", "WeightSyncSender", "export_tensors", "plan_digest"]
