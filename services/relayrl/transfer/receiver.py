"""The receiving end of a version, inside an engine worker (relayrl's vLLM worker extension
calls `receive_tensors` from its `relayrl_receive` method).

The plan comes from the weight-sync service over gRPC (and must hash to the digest the
coordinator announced); the buckets come over the data plane the coordinator chose:

    grpc               the worker pulls them from the service (PullBuckets streaming)
    torch_distributed  the service broadcasts them to every worker of every replica
    mooncake           the service writes them into this worker's registered buffers

Whatever the data plane, buckets arrive in plan order, each is checked against its sha256,
and they are cut back into HF-named tensors as they complete, so the worker's load path
consumes them as a stream: beyond the model itself a worker holds the data plane's bucket
buffers (one for gRPC, two for the others) and at most one partly assembled tensor. FP8 tensors
are dequantised to the engine's dtype with their scales (a scale is planned before its weight,
so nothing waits). Every wait has a deadline.

Imported only inside the engine process, and only when a version arrives.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from relayrl.proto.common.v1 import common_pb2
from relayrl.transfer.plan import BucketAssembler, BucketLayout, layouts_from_plan, plan_digest

QUANT_MODES = {
    common_pb2.QUANTIZATION_FP8_PER_TENSOR: "per_tensor",
    common_pb2.QUANTIZATION_FP8_BLOCK_128: "block_128",
}

FAULT_EXIT_AFTER_BUCKET = "RELAYRL_FAULT_EXIT_AFTER_BUCKET"
"""Fault injection for tests: a worker whose environment sets this to N dies (exit 137) right
after receiving bucket N over a broadcast data plane, i.e. mid-transfer."""


class ReceiveError(RuntimeError):
    """A version could not be received; the message names the boundary and the bucket."""


# (bucket index, its bytes as a 1-D uint8 tensor valid until the next bucket, sha256 hex)
Buckets = Iterator[tuple[int, torch.Tensor, str]]


def receive_tensors(
    request: dict[str, Any],
    stats: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    *,
    worker_rank: int = 0,
    resources: dict[str, Any] | None = None,
    engine_fp8: str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of the transfer `request["transfer_id"]`, whose plan comes from the
    weight-sync service at `request["target"]` and whose buckets come over
    `request["transport"]` (default grpc). For a broadcast data plane the request also holds
    `spec` (the TransportSpec as JSON), `receiver_rank_base` (this replica's first receiver
    rank; `worker_rank` is added) and `bucket_sha256` (what every bucket must hash to);
    `resources` go to the transport (a reused Mooncake engine). `engine_fp8` ("per_tensor" |
    "block_128"): the engine serves an FP8 checkpoint in that format, so FP8 tensors and their
    scales are passed on as they are instead of dequantised. Fills `stats` with the loaded
    buckets' sha256 (in plan order), bytes and seconds."""
    import grpc

    from relayrl.core.grpc_client import channel_options
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

    transfer_id = request["transfer_id"]
    timeout_s = float(request.get("timeout_s", 300.0))
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    # Without BDP probing gRPC keeps its receive window small: with it, the service fills
    # ~100 MiB of this worker's buffers while the worker loads (measured by the bench).
    options = [*channel_options(max_message_bytes=256 * 1024 * 1024), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(request["target"], options=options)
    try:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        plan = stub.GetBucketPlan(
            pb.GetBucketPlanRequest(transfer_id=transfer_id), timeout=timeout_s
        )
        layouts = layouts_from_plan(plan)
        if plan_digest(layouts) != request["plan_digest"]:
            raise ReceiveError(
                f"transport: the plan of {transfer_id} differs from the one the coordinator "
                "announced; refusing to load"
            )
        transport = request.get("transport", "grpc")
        if transport == "grpc":
            buckets = _pull_over_grpc(stub, request, layouts, deadline)
        else:
            buckets = _receive_over_data_plane(
                request, layouts, request["receiver_rank_base"] + worker_rank, resources or {}
            )
        digests: list[str] = []
        yield from _tensors(plan, layouts, buckets, dtype, digests, engine_fp8)
        if len(digests) != len(layouts):
            raise ReceiveError(
                f"transport: {len(digests)} of {len(layouts)} buckets of {transfer_id} arrived"
            )
    except grpc.RpcError as exc:
        raise ReceiveError(
            f"transport: pulling {transfer_id} from {request['target']}: "
            f"{exc.code().name}: {exc.details()}"
        ) from None
    finally:
        channel.close()
    stats.update(
        bucket_sha256=digests,
        bytes=sum(b.size_bytes for b in layouts),
        seconds=time.monotonic() - start,
    )


def _tensors(
    plan: Any,
    layouts: list[BucketLayout],
    buckets: Buckets,
    dtype: torch.dtype,
    digests: list[str],
    engine_fp8: str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Buckets cut back into tensors; FP8 ones dequantised to `dtype`, or, for an engine that
    loads FP8 in the `engine_fp8` format, passed on with their scales (except embeddings and
    lm_head, which FP8 engines keep in bf16). Appends each bucket's sha256 to `digests`."""
    from relayrl.transfer.quant import EMBEDDING_NAME_PARTS, dequantize_fp8

    dequantized: dict[str, tuple[str, str]] = {}  # weight -> (mode, its scale's name)
    for t in (t for b in plan.buckets for t in b.tensors if t.quantization in QUANT_MODES):
        mode = QUANT_MODES[t.quantization]
        if engine_fp8 is None or any(part in t.name for part in EMBEDDING_NAME_PARTS):
            dequantized[t.name] = (mode, t.scale_name)
        elif mode != engine_fp8:
            raise ReceiveError(
                f"export: {t.name} comes as FP8 {mode} but the engine loads FP8 {engine_fp8}; "
                f"publish with quantization fp8_{engine_fp8}"
            )
    scale_names = {scale for _, scale in dequantized.values()}
    scales: dict[str, torch.Tensor] = {}
    assembler = BucketAssembler(layouts)
    for index, data, digest in buckets:
        digests.append(digest)
        for name, tensor in assembler.stream(index, data):
            if name in scale_names:  # planned before its weight
                scales[name] = tensor
            elif name in dequantized:
                mode, scale_name = dequantized[name]
                yield name, dequantize_fp8(tensor, scales.pop(scale_name), mode, dtype)
            else:
                yield name, tensor
    assembler.finish()


def _pull_over_grpc(
    stub: Any, request: dict[str, Any], layouts: list[BucketLayout], deadline: float
) -> Buckets:
    """The buckets pulled from the service, into one reused buffer hashed as it fills (no
    per-bucket join, no second pass)."""
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

    transfer_id = request["transfer_id"]
    buffer = torch.empty(max((b.size_bytes for b in layouts), default=0), dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    hasher = hashlib.sha256()
    filled = 0
    stream = stub.PullBuckets(
        pb.PullBucketsRequest(replica_id=request.get("replica_id", ""), transfer_id=transfer_id),
        timeout=max(1.0, deadline - time.monotonic()),
    )
    for chunk in stream:
        payload = chunk.data  # each access to a bytes field copies it (upb): once per chunk
        size = len(payload)
        if chunk.offset_bytes != filled or filled + size > len(view):
            raise ReceiveError(
                f"transport: bucket {chunk.bucket_index} of {transfer_id}: chunk at offset "
                f"{chunk.offset_bytes} does not fit the plan"
            )
        view[filled : filled + size] = payload
        hasher.update(payload)
        filled += size
        if not chunk.last:
            continue
        digest = hasher.hexdigest()
        if digest != chunk.bucket_sha256:
            raise ReceiveError(
                f"transport: bucket {chunk.bucket_index} of {transfer_id} arrived corrupted "
                "(sha256 mismatch)"
            )
        yield chunk.bucket_index, buffer[:filled], digest
        hasher, filled = hashlib.sha256(), 0


def _receive_over_data_plane(
    request: dict[str, Any],
    layouts: list[BucketLayout],
    receiver_rank: int,
    resources: dict[str, Any],
) -> Buckets:
    """The buckets as the service broadcasts them (torch_distributed) or writes them
    (mooncake) to receiver `receiver_rank`; each checked against the sha256 the service
    holds."""
    from relayrl.transfer.transports.base import TransportError, TransportSpec, open_source

    transfer_id = request["transfer_id"]
    try:
        spec = TransportSpec.from_json(request["spec"])
    except (KeyError, ValueError) as exc:
        raise ReceiveError(
            f"transport: no usable data-plane spec for {transfer_id}: {exc}"
        ) from None
    expected = list(request.get("bucket_sha256", []))
    sizes = tuple(b.size_bytes for b in layouts)
    if (
        spec.type != request["transport"]
        or spec.bucket_sizes != sizes
        or len(expected) != len(sizes)
    ):
        raise ReceiveError(
            f"transport: the {spec.type} spec of {transfer_id} does not match its plan "
            f"({spec.num_buckets} buckets in the spec, {len(sizes)} in the plan, "
            f"{len(expected)} checksums)"
        )
    exit_after = os.environ.get(FAULT_EXIT_AFTER_BUCKET)
    try:
        with open_source(spec, receiver_rank, **resources) as source:
            for index in range(spec.num_buckets):
                data = source.recv(index)
                if exit_after is not None and index == int(exit_after):
                    os._exit(137)
                digest = hashlib.sha256(memoryview(data.cpu().numpy())).hexdigest()
                if digest != expected[index]:
                    raise ReceiveError(
                        f"transport: bucket {index} of {transfer_id} arrived corrupted "
                        "(sha256 mismatch)"
                    )
                yield index, data, digest
    except TransportError as exc:
        raise ReceiveError(f"transport: {exc}") from None
