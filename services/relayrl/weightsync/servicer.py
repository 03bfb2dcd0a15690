"""The WeightSync gRPC service: translates requests to the Coordinator and back. Every refusal
says what to fix (INVALID_ARGUMENT, FAILED_PRECONDITION for a plan mismatch, NOT_FOUND for an
unknown transfer, DATA_LOSS for a corrupted bucket)."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc
from relayrl.weightsync.coordinator import Coordinator, PlanMismatch, SyncError, Transfer
from relayrl.weightsync.versions import Bucket

MAX_FINAL_WAIT_S = 600.0
"""Longest a GetBucketPlan may hold for the transfer's outcome."""
FINAL_WAIT_MARGIN_S = 0.5
"""A waiting GetBucketPlan answers this long before the caller's deadline."""


def _version(coordinator: Coordinator) -> common_pb2.WeightVersion:
    committed = coordinator.committed
    if committed is None:
        return common_pb2.WeightVersion(version=0)
    return common_pb2.WeightVersion(
        version=committed.version,
        trainer_step=committed.trainer_step,
        checksum=committed.plan_digest,
    )


class SharedChunks:
    """The serialised chunk messages of the buckets pulled last: receivers that pull the same
    version at once (cut-through pulls move in step) share one copy of each chunk, so the
    service copies a chunk once however many receivers there are. At most `keep` buckets are
    kept, and none once the last puller is done; a puller far behind the others builds its
    own."""

    def __init__(self, chunk_bytes: int, keep: int = 2) -> None:
        self._chunk_bytes = chunk_bytes
        self._keep = keep
        self._cache: OrderedDict[tuple[str, int], list[bytes]] = OrderedDict()
        self._pullers = 0

    @contextlib.contextmanager
    def pulling(self) -> Iterator[None]:
        """Around one puller's stream: the cache lives while anyone pulls."""
        self._pullers += 1
        try:
            yield
        finally:
            self._pullers -= 1
            if not self._pullers:
                self._cache.clear()

    def of(self, transfer: Transfer, index: int, data: Bucket) -> list[bytes]:
        key = (transfer.transfer_id, index)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        view = memoryview(data)
        chunks = []
        for offset in range(0, max(len(data), 1), self._chunk_bytes):
            last = offset + self._chunk_bytes >= len(data)
            chunks.append(
                pb.BucketChunk(
                    transfer_id=transfer.transfer_id,
                    bucket_index=index,
                    offset_bytes=offset,
                    data=bytes(view[offset : offset + self._chunk_bytes]),
                    last=last,
                    bucket_sha256=transfer.sha256[index] if last else "",
                ).SerializeToString()
            )
        self._cache[key] = chunks
        while len(self._cache) > self._keep:
            self._cache.popitem(last=False)
        return chunks


class WeightSyncServicer(weightsync_pb2_grpc.WeightSyncServicer):
    def __init__(self, coordinator: Coordinator, *, chunk_bytes: int) -> None:
        self._c = coordinator
        self._chunks = SharedChunks(chunk_bytes)

    async def RegisterSender(
        self, request: pb.RegisterSenderRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterSenderResponse:
        if request.world_size < 1 or not 0 <= request.rank < request.world_size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {request.rank} is not in [0, world_size={request.world_size})",
            )
        return pb.RegisterSenderResponse(committed=_version(self._c))

    async def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterEngineResponse:
        if not request.replica_id or not request.url.startswith(("http://", "https://")):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "give replica_id and the engine's base url (http://host:port)",
            )
        needs_pull = self._c.register_engine(
            request.replica_id, request.url, request.current_version, routed=request.routed
        )
        return pb.RegisterEngineResponse(committed=_version(self._c), needs_pull=needs_pull)

    async def Publish(
        self, request: pb.PublishRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishResponse:
        if request.transport not in (pb.TRANSPORT_TYPE_UNSPECIFIED, pb.TRANSPORT_TYPE_GRPC):
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "senders push buckets to this service over gRPC (transport GRPC); the data "
                "plane from here to the engines is the service's data_plane.transport setting",
            )
        try:
            transfer = self._c.publish(
                request.version,
                request.trainer_step,
                request.tensors,
                supersede=request.supersede,
                base_transfer_id=request.base_transfer_id,
            )
        except PlanMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.PublishResponse(plan=self._c.plan_proto(transfer))

    async def GetBucketPlan(
        self, request: pb.GetBucketPlanRequest, context: grpc.aio.ServicerContext
    ) -> pb.BucketPlan:
        wait_s = request.wait_for_final_s
        if not 0.0 <= wait_s <= MAX_FINAL_WAIT_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"wait_for_final_s must be in [0, {MAX_FINAL_WAIT_S:g}], got {wait_s:g}",
            )
        try:
            transfer = self._c.transfer(request.transfer_id)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller gives up
            wait_s = min(wait_s, remaining - FINAL_WAIT_MARGIN_S)
        if wait_s > 0 and not transfer.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(transfer.done.wait(), wait_s)
        return self._c.plan_proto(transfer)

    async def PushBuckets(
        self, request_iterator: AsyncIterator[pb.BucketChunk], context: grpc.aio.ServicerContext
    ) -> pb.PushBucketsResponse:
        num_buckets = num_bytes = 0  # bytes as they came: a delta counts its own size
        parts: list[bytes] = []
        current: tuple[str, int, bool] | None = None
        async for chunk in request_iterator:
            key = (chunk.transfer_id, chunk.bucket_index, chunk.delta)
            if current is not None and key[:2] == current[:2] and key != current:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"bucket {current[1]}: set delta on every chunk of a delta bucket",
                )
            if current is not None and key != current:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"bucket {current[1]} ended without its last chunk (last=true)",
                )
            if chunk.offset_bytes != sum(len(p) for p in parts):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"bucket {chunk.bucket_index}: chunk at offset {chunk.offset_bytes}, "
                    f"expected {sum(len(p) for p in parts)}",
                )
            if chunk.shm and (chunk.offset_bytes or chunk.data or chunk.delta or not chunk.last):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"bucket {chunk.bucket_index}: a bucket in shared memory is one chunk at "
                    "offset 0, with last=true, no data and no delta",
                )
            current = key
            parts.append(chunk.data)
            if not chunk.last:
                continue
            data = b"".join(parts)
            parts, current = [], None
            try:
                self._c.put_bucket(
                    chunk.transfer_id,
                    chunk.bucket_index,
                    data,
                    chunk.bucket_sha256,
                    delta=chunk.delta,
                    shm=chunk.shm,
                )
            except KeyError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            except PlanMismatch as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except SyncError as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
            num_buckets += 1
            if chunk.shm:  # the bytes the sender wrote into shared memory
                num_bytes += (
                    self._c.transfer(chunk.transfer_id).layouts[chunk.bucket_index].size_bytes
                )
            else:
                num_bytes += len(data)
        if current is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the stream ended inside bucket {current[1]} (no chunk with last=true)",
            )
        return pb.PushBucketsResponse(num_buckets=num_buckets, num_bytes=num_bytes)

    async def PullBuckets(
        self, request: pb.PullBucketsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """The buckets in plan order, each as soon as a sender has pushed it (cut-through), as
        serialised BucketChunk messages shared by every puller of the same bucket. A puller on
        this host (`shm`) gets a bucket the sender left in shared memory as a chunk marked
        shm, without its bytes."""
        if request.transfer_id:
            try:
                transfer = self._c.transfer(request.transfer_id)
            except KeyError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        elif self._c.committed is not None:
            transfer = self._c.committed
        else:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no version is committed yet")
        with self._chunks.pulling():
            for index in range(len(transfer.layouts)):
                try:
                    data = await self._c.bucket(transfer, index)
                except SyncError as exc:
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"transfer {transfer.transfer_id} holds no complete set of buckets: {exc}",
                    )
                if request.shm and isinstance(data, mmap.mmap) and transfer.shm_slot:
                    yield pb.BucketChunk(
                        transfer_id=transfer.transfer_id,
                        bucket_index=index,
                        last=True,
                        bucket_sha256=transfer.sha256[index],
                        shm=True,
                    ).SerializeToString()
                    continue
                for message in self._chunks.of(transfer, index, data):
                    yield message

    async def AckVersion(
        self, request: pb.AckVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckVersionResponse:
        entry = self._c.engines.get(request.replica_id)
        if entry is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown replica {request.replica_id!r}: register it"
            )
        if request.ok:
            entry.version = request.version
        else:
            entry.last_error = request.error
        return pb.AckVersionResponse(committed=self._c.committed_version == request.version)

    async def GetVersion(
        self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetVersionResponse:
        active = (
            pb.TRANSFER_STATE_PLANNED,
            pb.TRANSFER_STATE_TRANSFERRING,
            pb.TRANSFER_STATE_LOADING,
        )
        in_progress = next((t for t in self._c.transfers.values() if t.state in active), None)
        live = {e.replica_id for e in self._c.live_entries()}
        return pb.GetVersionResponse(
            committed=_version(self._c),
            in_progress=self._c.plan_proto(in_progress) if in_progress else None,
            replicas=[
                pb.ReplicaVersion(
                    replica_id=e.replica_id, version=e.version, live=e.replica_id in live
                )
                for e in self._c.engines.values()
            ],
        )


def _serialized(message: Any) -> bytes:
    """A response as it goes on the wire: PullBuckets yields chunks serialised already."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(servicer: WeightSyncServicer, server: grpc.aio.Server) -> None:
    """Registers `servicer` as the generated code would, except that PullBuckets' chunks go out
    as the bytes `SharedChunks` serialised once."""
    service = pb.DESCRIPTOR.services_by_name["WeightSync"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        handlers[method.name] = kinds[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=request_type.FromString,
            response_serializer=(
                _serialized if method.name == "PullBuckets" else response_type.SerializeToString
            ),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
