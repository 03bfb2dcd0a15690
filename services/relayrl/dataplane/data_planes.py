"""The data planes a version can reach the engine workers over, in one table keyed by the name
weight-sync's `data_plane.transport` setting gives:

    grpc               each worker pulls the buckets from the service (PullBuckets streaming)
    shm                the same pull, but a worker on the service's host reads each bucket
                       from the shared-memory file the sender wrote (relayrl.dataplane.shm)
    torch_distributed  the service broadcasts them to every worker of every replica
    mooncake           the service writes them into every worker's registered buffers

An entry is the data plane's receiving end (`buckets`, run in the worker) and how weight-sync
delivers over it (`broadcast`): replica by replica, each replica's workers fetching the
buckets themselves, or once for all replicas, with one `TransportSpec` per attempt naming every
worker a receiver. The broadcast entries are the backends of
`relayrl.dataplane.transports.base.TRANSPORTS`.
"""

from __future__ import annotations

import abc
import hashlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

import torch

from relayrl.dataplane.transports.base import TRANSPORTS

if TYPE_CHECKING:
    from relayrl.dataplane.plan import BucketLayout
    from relayrl.dataplane.request import ReceiveRequest
    from relayrl.dataplane.transports.base import KeptResources

FAULT_EXIT_AFTER_BUCKET = "RELAYRL_FAULT_EXIT_AFTER_BUCKET"
"""Fault injection for tests: a worker whose environment sets this to N dies (exit 137) right
after receiving bucket N over a broadcast data plane, i.e. mid-transfer."""


class ReceiveError(RuntimeError):
    """A version could not be received; the message names the boundary and the bucket."""


# (bucket index, its bytes as a 1-D uint8 tensor valid until the next bucket, sha256 hex)
Buckets = Iterator[tuple[int, torch.Tensor, str]]


@dataclass(frozen=True)
class Receiving:
    """One worker's receive of one version, as a data plane's receiving end sees it."""

    request: ReceiveRequest
    layouts: list[BucketLayout]
    stub: Any
    """The WeightSync stub of the service the plan came from."""
    deadline: float
    """`time.monotonic()` by which every bucket has arrived."""
    worker_rank: int
    resources: KeptResources | None
    """What the worker keeps across transfers (a Mooncake engine); None: nothing, each
    backend starts its own per transfer."""
    shm_dir: str = ""
    shm_token: str = ""
    """The plan's shared-memory slot and its host token (empty: none)."""


class DataPlane(abc.ABC):
    broadcast: ClassVar[bool]
    """True: weight-sync sends each bucket once to every worker of every replica it loads;
    False: it loads replica by replica, and each worker fetches the buckets itself."""

    @abc.abstractmethod
    def buckets(self, receiving: Receiving) -> Buckets:
        """The buckets in plan order, each checked against its sha256 (ReceiveError)."""


class GrpcPull(DataPlane):
    """Each worker pulls the buckets from the service, into one reused buffer hashed as it
    fills (no per-bucket join, no second pass). With `shm`, a worker that shares the service's
    host reads the buckets the sender left in shared memory from their files instead (into
    the same buffer, hashed the same way); a worker elsewhere pulls their bytes."""

    broadcast = False

    def __init__(self, *, shm: bool = False) -> None:
        self._shm = shm

    def buckets(self, receiving: Receiving) -> Buckets:
        from relayrl.dataplane.shm import shares_host
        from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb

        request, layouts = receiving.request, receiving.layouts
        transfer_id = request.transfer_id
        buffer = torch.empty(max((b.size_bytes for b in layouts), default=0), dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        hasher = hashlib.sha256()
        filled = 0
        local = self._shm and shares_host(receiving.shm_dir, receiving.shm_token)
        stream = receiving.stub.PullBuckets(
            pb.PullBucketsRequest(
                replica_id=request.replica_id, transfer_id=transfer_id, shm=local
            ),
            timeout=max(1.0, receiving.deadline - time.monotonic()),
        )
        for chunk in stream:
            if chunk.shm:
                if not local or filled:
                    raise ReceiveError(
                        f"transport: bucket {chunk.bucket_index} of {transfer_id} came as a "
                        "shared-memory file this worker did not ask for"
                    )
                filled = self._read_file(receiving, chunk.bucket_index, view)
                hasher.update(view[:filled])
            else:
                payload = chunk.data  # each access to a bytes field copies it (upb): once
                size = len(payload)
                if chunk.offset_bytes != filled or filled + size > len(view):
                    raise ReceiveError(
                        f"transport: bucket {chunk.bucket_index} of {transfer_id}: chunk at "
                        f"offset {chunk.offset_bytes} does not fit the plan"
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

    @staticmethod
    def _read_file(receiving: Receiving, index: int, view: memoryview) -> int:
        """Bucket `index` from the transfer's shared-memory slot into `view`; its size."""
        from relayrl.dataplane.shm import read_bucket

        transfer_id = receiving.request.transfer_id
        if not 0 <= index < len(receiving.layouts):
            raise ReceiveError(f"transport: bucket {index} is not in the plan of {transfer_id}")
        size = receiving.layouts[index].size_bytes
        try:
            read_bucket(receiving.shm_dir, index, view[:size])
        except OSError as exc:
            raise ReceiveError(
                f"transport: bucket {index} of {transfer_id} in shared memory: {exc}"
            ) from None
        return size


class Broadcast(DataPlane):
    """The buckets as the service broadcasts them (torch_distributed) or writes them
    (mooncake) to this worker's receiver rank; each checked against the sha256 the service
    holds."""

    broadcast = True

    def buckets(self, receiving: Receiving) -> Buckets:
        from relayrl.dataplane.transports.base import TransportError, open_source

        request, spec = receiving.request, receiving.request.spec
        transfer_id = request.transfer_id
        if spec is None or request.receiver_rank_base is None:
            raise ReceiveError(f"transport: no usable data-plane spec for {transfer_id}")
        expected = request.bucket_sha256
        sizes = tuple(b.size_bytes for b in receiving.layouts)
        if spec.bucket_sizes != sizes or len(expected) != len(sizes):
            raise ReceiveError(
                f"transport: the {spec.type} spec of {transfer_id} does not match its plan "
                f"({spec.num_buckets} buckets in the spec, {len(sizes)} in the plan, "
                f"{len(expected)} checksums)"
            )
        receiver_rank = request.receiver_rank_base + receiving.worker_rank
        resources = receiving.resources.for_spec(spec) if receiving.resources else {}
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


DATA_PLANES: Final[Mapping[str, DataPlane]] = {
    "grpc": GrpcPull(),
    "shm": GrpcPull(shm=True),
    **{name: Broadcast() for name in TRANSPORTS},
}
