"""PullBuckets' chunks are built and serialised once per bucket for every receiver that pulls
it while it is among the last buckets pulled, and parse back into the bucket."""

from __future__ import annotations

import hashlib
from typing import Any

from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.servicer import SharedChunks, _serialized


class Transfer:
    """What SharedChunks reads of a transfer."""

    def __init__(self, transfer_id: str, buckets: list[bytes]) -> None:
        self.transfer_id = transfer_id
        self.sha256 = [hashlib.sha256(b).hexdigest() for b in buckets]


def test_receivers_in_step_share_one_copy_and_a_far_behind_one_builds_its_own() -> None:
    buckets = [bytes([i]) * 10 for i in range(4)]
    transfer: Any = Transfer("v1-abc", buckets)
    chunks = SharedChunks(chunk_bytes=4, keep=2)
    first = chunks.of(transfer, 0, buckets[0])
    assert chunks.of(transfer, 0, buckets[0]) is first  # the second receiver: the same bytes
    messages = [pb.BucketChunk.FromString(m) for m in first]
    assert [m.offset_bytes for m in messages] == [0, 4, 8]
    assert [m.last for m in messages] == [False, False, True]
    assert b"".join(m.data for m in messages) == buckets[0]
    assert messages[-1].bucket_sha256 == transfer.sha256[0]
    assert {m.transfer_id for m in messages} == {"v1-abc"} and {
        m.bucket_index for m in messages
    } == {0}
    chunks.of(transfer, 1, buckets[1])
    chunks.of(transfer, 2, buckets[2])  # bucket 0 leaves the cache
    again = chunks.of(transfer, 0, buckets[0])
    assert again is not first and again == first
    assert _serialized(first[0]) is first[0]  # sent as they are
    assert _serialized(messages[0]) == first[0]


def test_nothing_is_kept_once_the_last_puller_is_done() -> None:
    buckets = [bytes([i]) * 10 for i in range(2)]
    transfer: Any = Transfer("v1", buckets)
    chunks = SharedChunks(chunk_bytes=4)
    with chunks.pulling():
        with chunks.pulling():
            first = chunks.of(transfer, 0, buckets[0])
        assert chunks.of(transfer, 0, buckets[0]) is first  # one puller still pulls
    assert chunks.of(transfer, 0, buckets[0]) is not first  # built again: none was kept


def test_an_empty_bucket_is_one_last_chunk() -> None:
    transfer: Any = Transfer("v2", [b""])
    (only,) = SharedChunks(chunk_bytes=4).of(transfer, 0, b"")
    message = pb.BucketChunk.FromString(only)
    assert message.last and message.data == b"" and message.bucket_sha256 == transfer.sha256[0]
