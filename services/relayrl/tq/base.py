"""The TransferQueue's key layout, limits and connection errors, shared by the read, event and
transition operations of both clients (relayrl.tq.queue puts them together)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import redis

from relayrl.tq import codec
from relayrl.tq.errors import InvalidInputError, TQError
from relayrl.tq.steps import Script


class TQUnavailableError(TQError, ConnectionError):
    """Redis could not be reached or did not answer in time."""


class TQAuthenticationError(TQError):
    """Redis refused the credentials (tq.url / tq.password_env)."""


class DurabilityError(TQError):
    """The Redis server is not configured for the durability the queue was promised."""


@contextlib.contextmanager
def unavailable_as_tq_error() -> Iterator[None]:
    """Turns a lost or stuck Redis connection into TQUnavailableError (one clear message)."""
    try:
        yield
    except redis.AuthenticationError as exc:
        raise TQAuthenticationError(
            f"TransferQueue Redis refused the credentials ({exc}): check tq.url and tq.password_env"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise TQUnavailableError(f"TransferQueue Redis is unavailable: {exc}") from exc


def _partition_key_prefix(namespace: str, partition: str) -> str:
    """The prefix of every key of one partition. Private to relayrl.tq: everyone else reads the
    queue through its methods (tests/unit/tq/test_tq_key_ownership.py enforces it); a test that
    corrupts or inspects raw state on purpose asks relayrl.tq.testing."""
    return f"{{{namespace}}}:p:{partition}:"


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidInputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class QueueBase:
    """The namespace's keys, the queue's limits and the steps its operations are built from
    (relayrl.tq.steps). No I/O: the client that subclasses it (relayrl.tq.queue) runs them."""

    # The runner of the client's operations, built on its Redis client (relayrl.tq.runners).
    _runner_type: ClassVar[Callable[[Any], Any]]

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "relayrl",
        max_value_bytes: int = 32 * 1024 * 1024,
        event_stream_max_len: int = 1_000_000,
        durability: str = "everysec",
    ) -> None:
        self._redis = client
        self._ns = namespace
        self._max_value_bytes = max_value_bytes
        self._event_stream_max_len = event_stream_max_len
        self._durability = durability
        self._runner = self._runner_type(client)

    @property
    def namespace(self) -> str:
        return self._ns

    def _block_ms(self, block_ms: int) -> int:
        """`block_ms` of a blocking read, refused unless it ends before the connection's socket
        timeout: a longer block would turn every quiet wait into a lost connection."""
        timeout_s = self._redis.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout_s is not None and block_ms >= timeout_s * 1000:
            raise InvalidInputError(
                f"a blocking read of {block_ms} ms needs a Redis socket timeout above it "
                f"(tq.socket_timeout_s is {timeout_s:g} s)"
            )
        return block_ms

    # -- keys and steps -------------------------------------------------------------------

    def _partitions_key(self) -> str:
        return f"{{{self._ns}}}:partitions"

    def _key_prefix(self, partition: str) -> str:
        return _partition_key_prefix(self._ns, partition)

    def _events_key(self, partition: str) -> str:
        return f"{self._key_prefix(partition)}events"

    def _dead_key(self, partition: str) -> str:
        return f"{self._key_prefix(partition)}dead"

    def _script(self, partition: str, script: str, *args: Any) -> Script:
        """A step running one of the partition scripts (the prelude's calling convention)."""
        codec.check_partition_name(partition)
        argv = [self._key_prefix(partition), partition, self._event_stream_max_len, *args]
        return Script(partition, script, [self._partitions_key()], argv)
