"""The receiving end of a version, inside an engine worker (relayrl's vLLM worker extension
calls `receive_tensors` from its `relayrl_receive` method).

Buckets are pulled in plan order, each checked against its sha256, and cut back into HF-named
tensors as they complete, so the worker's load path consumes them as a stream: beyond the
model itself a worker holds one bucket and at most one partly assembled tensor. FP8 tensors
are dequantised to the engine's dtype with their scales (a scale is planned before its weight,
so nothing waits). Every wait has the request's deadline.

Imported only inside the engine process, and only when a version arrives.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from relayrl.proto.common.v1 import common_pb2
from relayrl.weightsync.plan import BucketAssembler, BucketLayout, Piece, plan_digest

QUANT_MODES = {
    common_pb2.QUANTIZATION_FP8_PER_TENSOR: "per_tensor",
    common_pb2.QUANTIZATION_FP8_BLOCK_128: "block_128",
}


class ReceiveError(RuntimeError):
    """A version could not be received; the message names the boundary and the bucket."""


def layouts_from_plan(plan: Any) -> list[BucketLayout]:
    return [
        BucketLayout(
            index=b.index,
            size_bytes=b.size_bytes,
            pieces=tuple(Piece.from_proto(t) for t in b.tensors),
        )
        for b in plan.buckets
    ]


def receive_tensors(
    request: dict[str, Any], stats: dict[str, Any], dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of the transfer `request["transfer_id"]`, pulled from the weight-sync
    service at `request["target"]` over gRPC. Fills `stats` with the loaded buckets' sha256
    (in plan order), bytes and seconds."""
    import grpc

    from relayrl.core.grpc_client import channel_options
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
    from relayrl.weightsync.quant import dequantize_fp8

    timeout_s = float(request.get("timeout_s", 300.0))
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    channel = grpc.insecure_channel(
        request["target"], options=channel_options(max_message_bytes=256 * 1024 * 1024)
    )
    try:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        plan = stub.GetBucketPlan(
            pb.GetBucketPlanRequest(transfer_id=request["transfer_id"]), timeout=timeout_s
        )
        layouts = layouts_from_plan(plan)
        if plan_digest(layouts) != request["plan_digest"]:
            raise ReceiveError(
                f"transport: the plan of {request['transfer_id']} differs from the one the "
                "coordinator announced; refusing to load"
            )
        quant = {
            t.name: (QUANT_MODES[t.quantization], t.scale_name)
            for b in plan.buckets
            for t in b.tensors
            if t.quantization in QUANT_MODES
        }
        scale_names = {scale for _, scale in quant.values()}
        scales: dict[str, torch.Tensor] = {}
        assembler = BucketAssembler(layouts)
        digests: list[str] = []
        # One reused bucket buffer, hashed as it fills: no per-bucket join, no second pass.
        buffer = torch.empty(max((b.size_bytes for b in layouts), default=0), dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        hasher = hashlib.sha256()
        filled = 0
        num_bytes = 0
        stream = stub.PullBuckets(
            pb.PullBucketsRequest(
                replica_id=request.get("replica_id", ""), transfer_id=request["transfer_id"]
            ),
            timeout=max(1.0, deadline - time.monotonic()),
        )
        for chunk in stream:
            size = len(chunk.data)
            if chunk.offset_bytes != filled or filled + size > len(view):
                raise ReceiveError(
                    f"transport: bucket {chunk.bucket_index} of {request['transfer_id']}: "
                    f"chunk at offset {chunk.offset_bytes} does not fit the plan"
                )
            view[filled : filled + size] = chunk.data
            hasher.update(chunk.data)
            filled += size
            if not chunk.last:
                continue
            data = buffer[:filled]
            digest, hasher, filled = hasher.hexdigest(), hashlib.sha256(), 0
            if digest != chunk.bucket_sha256:
                raise ReceiveError(
                    f"transport: bucket {chunk.bucket_index} of {request['transfer_id']} "
                    "arrived corrupted (sha256 mismatch)"
                )
            digests.append(digest)
            num_bytes += data.numel()
            for name, tensor in assembler.feed(chunk.bucket_index, data):
                if name in scale_names:
                    scales[name] = tensor
                elif name in quant:
                    mode, scale_name = quant[name]
                    yield name, dequantize_fp8(tensor, scales.pop(scale_name), mode, dtype)
                else:
                    yield name, tensor
        assembler.finish()
        if len(digests) != len(layouts):
            raise ReceiveError(
                f"transport: {len(digests)} of {len(layouts)} buckets of "
                f"{request['transfer_id']} arrived"
            )
    except grpc.RpcError as exc:
        raise ReceiveError(
            f"transport: pulling {request['transfer_id']} from {request['target']}: "
            f"{exc.code().name}: {exc.details()}"
        ) from None
    finally:
        channel.close()
    stats.update(bucket_sha256=digests, bytes=num_bytes, seconds=time.monotonic() - start)
