"""Errors raised by the TransferQueue.

Every error names the key and partition it is about, so a caller (or an operator reading a
log line) knows what to fix. Errors for bad input derive from ValueError; errors about the
queue's state (an illegal transition, a stale claim) derive from TQStateError.
"""

from __future__ import annotations


class TQError(Exception):
    """Base of every TransferQueue error."""


class InvalidInputError(TQError, ValueError):
    """The caller passed something the queue cannot store (wrong type, malformed, too big)."""


class UnknownPartitionError(InvalidInputError, LookupError):
    def __init__(self, partition: str) -> None:
        super().__init__(
            f"unknown TransferQueue partition {partition!r}: create it first "
            "(TransferQueue.create_partition) or fix the partition name"
        )
        self.partition = partition


class TQStateError(TQError):
    """The request does not fit the state a key is in."""


class IllegalTransitionError(TQStateError):
    def __init__(
        self, partition: str, key: str, current: str, requested: str, detail: str = ""
    ) -> None:
        message = (
            f"illegal transition of {partition}/{key}: it is {current!r}, "
            f"cannot move to {requested!r}"
        )
        super().__init__(f"{message} ({detail})" if detail else message)
        self.partition, self.key = partition, key
        self.current, self.requested = current, requested


class UnknownKeyError(TQStateError, KeyError):
    def __init__(self, partition: str, key: str) -> None:
        super().__init__(f"{partition}/{key} does not exist in the TransferQueue")
        self.partition, self.key = partition, key

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ConflictError(TQStateError):
    """A put reused a key with different content (a retried put with the same content is fine)."""

    def __init__(self, partition: str, key: str) -> None:
        super().__init__(
            f"{partition}/{key} already exists with different content; keys are write-once "
            "(a retried put of identical content is a no-op)"
        )
        self.partition, self.key = partition, key


class StaleClaimError(IllegalTransitionError):
    """A writer's claim on a group was released or expired; another claimer may own it now."""


class CorruptRecordError(TQError):
    """A stored value cannot be decoded: written by something other than this library."""

    def __init__(self, partition: str, key: str, detail: str) -> None:
        super().__init__(f"{partition}/{key} holds an undecodable record: {detail}")
        self.partition, self.key = partition, key
