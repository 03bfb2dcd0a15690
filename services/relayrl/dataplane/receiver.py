"""The receiving end of a version, inside an engine worker (relayrl's vLLM worker extension
calls `receive_tensors` from its `relayrl_receive` method).

The plan comes from the weight-sync service over gRPC (and must hash to the digest the
coordinator announced); the buckets come over the data plane the coordinator chose, a key of
`relayrl.dataplane.data_planes.DATA_PLANES`:

    grpc               the worker pulls them from the service (PullBuckets streaming)
    shm                the same, but on the service's host it reads them from shared memory
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

import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from relayrl.dataplane.data_planes import (
    DATA_PLANES,
    FAULT_EXIT_AFTER_BUCKET,
    Buckets,
    ReceiveError,
    Receiving,
)
from relayrl.dataplane.plan import BucketAssembler, BucketLayout, layouts_from_plan, plan_digest
from relayrl.dataplane.request import ReceiveRequest
from relayrl.dataplane.transports.base import KeptResources
from relayrl.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from relayrl.core.config import TlsClientConfig
    from relayrl.core.grpc_client import ClientIdentity

__all__ = [
    "FAULT_EXIT_AFTER_BUCKET",
    "QUANT_MODES",
    "Buckets",
    "ReceiveError",
    "ReceiveRequest",
    "layouts_from_plan",
    "receive_tensors",
]

QUANT_MODES = {
    common_pb2.QUANTIZATION_FP8_PER_TENSOR: "per_tensor",
    common_pb2.QUANTIZATION_FP8_BLOCK_128: "block_128",
}


def _identity(request: ReceiveRequest, tls: TlsClientConfig | None) -> ClientIdentity:
    """How this worker dials weight-sync: the request's token, over TLS with the engine's own
    CA exactly when both sides say TLS (a mismatch is a ReceiveError saying which side)."""
    from relayrl.core.config import ClientCredentialsConfig, ConfigError
    from relayrl.core.grpc_client import ClientIdentity

    if request.tls and tls is None:
        raise ReceiveError(
            f"transport: weight-sync at {request.target} serves TLS, but this engine has no "
            "weightsync_tls (the CA to check it with) in its config"
        )
    if tls is not None and not request.tls:
        raise ReceiveError(
            f"transport: this engine pulls weights over TLS only (weightsync_tls is set), but "
            f"weight-sync advertised plaintext at {request.target}"
        )
    try:
        identity = ClientIdentity.from_config(
            ClientCredentialsConfig(tls=tls), "engine weightsync_tls"
        )
    except ConfigError as exc:
        raise ReceiveError(f"transport: {exc}") from None
    return dataclasses.replace(identity, token=request.token or None)


def receive_tensors(
    request: ReceiveRequest | Mapping[str, Any],
    stats: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    *,
    worker_rank: int = 0,
    resources: KeptResources | None = None,
    engine_fp8: str | None = None,
    tls: TlsClientConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of the transfer `request.transfer_id`, whose plan comes from the
    weight-sync service at `request.target` and whose buckets come over `request.transport`
    (a request as a mapping is parsed with `ReceiveRequest.from_dict`). `worker_rank` is added
    to a broadcast's `receiver_rank_base`; `resources` is what this worker keeps across
    transfers (a Mooncake engine; without it, a backend starts its own per transfer).
    `engine_fp8` ("per_tensor" | "block_128"): the engine serves an FP8 checkpoint in that
    format, so FP8 tensors and their scales are passed on as they are instead of dequantised.
    `tls`: the engine's own TLS towards weight-sync (its CA; a client certificate under mutual
    TLS): required when the request says weight-sync serves TLS, and then plaintext is refused.
    Fills `stats` with the loaded buckets' sha256 (in plan order), bytes and seconds."""
    import grpc

    from relayrl.core.grpc_client import channel_options, sync_channel
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

    if not isinstance(request, ReceiveRequest):
        request = ReceiveRequest.from_dict(request)
    plane = DATA_PLANES.get(request.transport)
    if plane is None:
        raise ReceiveError(
            f"transport: unknown data plane {request.transport!r} (known: {sorted(DATA_PLANES)})"
        )
    transfer_id = request.transfer_id
    deadline = time.monotonic() + request.timeout_s
    start = time.monotonic()
    # Without BDP probing gRPC keeps its receive window small: with it, the service fills
    # ~100 MiB of this worker's buffers while the worker loads (measured by the bench).
    options = [*channel_options(max_message_bytes=256 * 1024 * 1024), ("grpc.http2.bdp_probe", 0)]
    channel = sync_channel(request.target, _identity(request, tls), options)
    try:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        plan = stub.GetBucketPlan(
            pb.GetBucketPlanRequest(transfer_id=transfer_id), timeout=request.timeout_s
        )
        layouts = layouts_from_plan(plan)
        if plan_digest(layouts) != request.plan_digest:
            raise ReceiveError(
                f"transport: the plan of {transfer_id} differs from the one the coordinator "
                "announced; refusing to load"
            )
        receiving = Receiving(
            request, layouts, stub, deadline, worker_rank, resources, plan.shm_dir, plan.shm_token
        )
        digests: list[str] = []
        yield from _tensors(plan, layouts, plane.buckets(receiving), dtype, digests, engine_fp8)
        if len(digests) != len(layouts):
            raise ReceiveError(
                f"transport: {len(digests)} of {len(layouts)} buckets of {transfer_id} arrived"
            )
    except grpc.RpcError as exc:
        raise ReceiveError(
            f"transport: pulling {transfer_id} from {request.target}: "
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
    tls: TlsClientConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Buckets cut back into tensors; FP8 ones dequantised to `dtype`, or, for an engine that
    loads FP8 in the `engine_fp8` format, passed on with their scales (except embeddings and
    lm_head, which FP8 engines keep in bf16). Appends each bucket's sha256 to `digests`."""
    from relayrl.dataplane.quant import EMBEDDING_NAME_PARTS, dequantize_fp8

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
