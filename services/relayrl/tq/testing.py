"""Raw Redis keys of the TransferQueue, for tests only: a test that corrupts a record, or checks
the stored keys against each other, on purpose. Everything else (services, the test kit,
benchmarks, every other test) reads the queue through TransferQueue's methods, and only tests
may import this module (tests/unit/tq/test_tq_key_ownership.py enforces both)."""

from __future__ import annotations

from relayrl.tq.base import _partition_key_prefix


def key_prefix_for_tests(namespace: str, partition: str) -> str:
    """The prefix of every key of `partition` in `namespace` (the layout: relayrl.tq.queue)."""
    return _partition_key_prefix(namespace, partition)
