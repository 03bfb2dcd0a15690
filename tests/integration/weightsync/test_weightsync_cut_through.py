"""The gRPC data plane cut through, on a real relayrl-weightsync process: pullers that start
when a version is planned get each bucket as soon as a sender has pushed it, not once the whole
version is there, and a push that dies half-way ends their pull with the reason instead of a
hang. No engine: the pullers are plain gRPC clients, as an engine worker's pull is."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from relayrl.core.service_process import ServiceProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

BUCKET = 64 * 1024
CHUNK = 16 * 1024
TIMEOUT_S = 3.0
# one bf16 tensor of three buckets
METAS = [common_pb2.TensorMeta(name="w", shape=[3 * BUCKET // 2], dtype=common_pb2.DTYPE_BFLOAT16)]
BUCKETS = [bytes([17 * (i + 1)]) * BUCKET for i in range(3)]


@pytest.fixture
def weightsync(tmp_path: Path) -> Iterator[ServiceProcess]:
    config = {
        "bucket_size_bytes": BUCKET,
        "chunk_size_bytes": CHUNK,
        "transfer_timeout_s": TIMEOUT_S,
    }
    with ServiceProcess("relayrl-weightsync", config, tmp_path / "ws") as service:
        yield service


def push(stub: weightsync_pb2_grpc.WeightSyncStub, transfer_id: str, index: int) -> None:
    data = BUCKETS[index]
    chunks = [
        pb.BucketChunk(
            transfer_id=transfer_id,
            bucket_index=index,
            offset_bytes=offset,
            data=data[offset : offset + CHUNK],
            last=offset + CHUNK >= len(data),
            bucket_sha256=hashlib.sha256(data).hexdigest() if offset + CHUNK >= len(data) else "",
        )
        for offset in range(0, len(data), CHUNK)
    ]
    stub.PushBuckets(iter(chunks), timeout=10)


class Puller:
    """One receiver's PullBuckets stream, read in a thread: each whole bucket (or the error
    that ended the stream) lands in `buckets`."""

    def __init__(self, target: str, transfer_id: str) -> None:
        self.buckets: queue.Queue[tuple[int, bytes] | grpc.RpcError | None] = queue.Queue()
        self._channel = grpc.insecure_channel(target)
        stub = weightsync_pb2_grpc.WeightSyncStub(self._channel)
        self._stream = stub.PullBuckets(pb.PullBucketsRequest(transfer_id=transfer_id), timeout=30)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        parts: list[bytes] = []
        try:
            for chunk in self._stream:
                parts.append(chunk.data)
                if chunk.last:
                    data = b"".join(parts)
                    assert hashlib.sha256(data).hexdigest() == chunk.bucket_sha256
                    self.buckets.put((chunk.bucket_index, data))
                    parts = []
            self.buckets.put(None)
        except grpc.RpcError as exc:
            self.buckets.put(exc)

    def next(self, timeout_s: float = 10.0) -> tuple[int, bytes] | grpc.RpcError | None:
        return self.buckets.get(timeout=timeout_s)

    def nothing_yet(self) -> bool:
        try:
            self.buckets.get(timeout=0.3)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self._thread.join(timeout=10)
        self._channel.close()


def test_pullers_get_each_bucket_as_soon_as_it_is_pushed(weightsync: ServiceProcess) -> None:
    with grpc.insecure_channel(weightsync.target) as channel:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        plan = stub.Publish(pb.PublishRequest(version=1, tensors=METAS), timeout=10).plan
        assert len(plan.buckets) == 3
        pullers = [Puller(weightsync.target, plan.transfer_id) for _ in range(2)]
        try:
            assert all(p.nothing_yet() for p in pullers)  # nothing pushed: they wait
            for index in range(3):
                push(stub, plan.transfer_id, index)
                for puller in pullers:  # bucket k arrives before bucket k+1 is pushed
                    assert puller.next() == (index, BUCKETS[index])
                    if index < 2:
                        assert puller.nothing_yet()
            assert [p.next() for p in pullers] == [None, None]  # the stream ends
        finally:
            for puller in pullers:
                puller.close()
        final = stub.GetBucketPlan(
            pb.GetBucketPlanRequest(transfer_id=plan.transfer_id, wait_for_final_s=10), timeout=30
        )
        assert final.state == pb.TRANSFER_STATE_COMMITTED


def test_a_push_that_dies_half_way_ends_the_pull_with_the_reason(
    weightsync: ServiceProcess,
) -> None:
    with grpc.insecure_channel(weightsync.target) as channel:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        plan = stub.Publish(pb.PublishRequest(version=1, tensors=METAS), timeout=10).plan
        puller = Puller(weightsync.target, plan.transfer_id)
        try:
            push(stub, plan.transfer_id, 0)  # then the sender dies
            assert puller.next() == (0, BUCKETS[0])
            error = puller.next(timeout_s=TIMEOUT_S + 10)
        finally:
            puller.close()
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "buckets [1, 2] did not arrive within 3s" in error.details()
        # a late puller is told at once
        late = Puller(weightsync.target, plan.transfer_id)
        try:
            refused = late.next()
        finally:
            late.close()
        assert isinstance(refused, grpc.RpcError)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_bucket_marked_shared_memory_is_refused_where_the_plan_has_none_or_it_carries_bytes(
    weightsync: ServiceProcess,
) -> None:
    """This service runs the grpc data plane: its plans name no shared-memory folder, so a
    sender cannot hand it a file; and a shared-memory chunk is one empty chunk."""
    with grpc.insecure_channel(weightsync.target) as channel:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        plan = stub.Publish(pb.PublishRequest(version=1, tensors=METAS), timeout=10).plan
        assert not plan.shm_dir and not plan.shm_token
        digest = hashlib.sha256(BUCKETS[0]).hexdigest()
        marked = pb.BucketChunk(
            transfer_id=plan.transfer_id, bucket_index=0, last=True, bucket_sha256=digest, shm=True
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushBuckets(iter([marked]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "marked shm, but the plan gave no shm_dir" in refused.value.details()
        with_bytes = pb.BucketChunk()
        with_bytes.CopyFrom(marked)
        with_bytes.data = BUCKETS[0]
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushBuckets(iter([with_bytes]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a bucket in shared memory is one chunk" in refused.value.details()
        push(stub, plan.transfer_id, 0)  # the transfer itself is unharmed
