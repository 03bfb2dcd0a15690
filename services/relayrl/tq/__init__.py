"""relayrl.tq: the TransferQueue on Redis — prompt groups and trajectories with tags, an atomic
status machine, event streams read by consumer groups, idempotent puts, AOF durability. One set
of operations, two clients: TransferQueue (sync) and AsyncTransferQueue (asyncio)."""

from relayrl.tq.config import TQConfig
from relayrl.tq.consumer import AsyncEventConsumer, EventConsumer
from relayrl.tq.errors import (
    ConflictError,
    CorruptRecordError,
    IllegalTransitionError,
    InvalidInputError,
    StaleClaimError,
    TQError,
    TQStateError,
    UnknownKeyError,
    UnknownPartitionError,
)
from relayrl.tq.model import (
    GROUP_TRANSITIONS,
    TRAJECTORY_TRANSITIONS,
    ClaimedGroup,
    ClaimResult,
    ConsumerGroupState,
    Counts,
    Event,
    GroupStatus,
    GroupWithTrajectories,
    Lease,
    NamedClaimResult,
    PartitionSnapshot,
    PendingEntry,
    PutResult,
    TrajectoryPut,
    TrajectoryStatus,
)
from relayrl.tq.queue import (
    AsyncTransferQueue,
    DurabilityError,
    TQAuthenticationError,
    TQUnavailableError,
    TransferQueue,
)

__all__ = [
    "GROUP_TRANSITIONS",
    "TRAJECTORY_TRANSITIONS",
    "AsyncEventConsumer",
    "AsyncTransferQueue",
    "ClaimResult",
    "ClaimedGroup",
    "ConflictError",
    "ConsumerGroupState",
    "CorruptRecordError",
    "Counts",
    "DurabilityError",
    "Event",
    "EventConsumer",
    "GroupStatus",
    "GroupWithTrajectories",
    "IllegalTransitionError",
    "InvalidInputError",
    "Lease",
    "NamedClaimResult",
    "PartitionSnapshot",
    "PendingEntry",
    "PutResult",
    "StaleClaimError",
    "TQAuthenticationError",
    "TQConfig",
    "TQError",
    "TQStateError",
    "TQUnavailableError",
    "TrajectoryPut",
    "TrajectoryStatus",
    "TransferQueue",
    "UnknownKeyError",
    "UnknownPartitionError",
]
