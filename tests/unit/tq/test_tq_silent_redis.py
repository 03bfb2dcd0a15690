"""Every Redis client of the TransferQueue's config is bounded, and a Redis that went silent
fails a command within tq.socket_timeout_s (docs/recovery.md#silent-peers), through the sync
and the asyncio client alike."""

from __future__ import annotations

import asyncio
import time

import pytest

from relayrl.tq import (
    AsyncEventConsumer,
    AsyncTransferQueue,
    TQConfig,
    TQUnavailableError,
    TransferQueue,
)
from relayrl.tq.errors import InvalidInputError
from relayrl.tq.queue import redis_options
from relayrl_testkit.helpers.silent_peer import SilentListener

TIMEOUT_S = 0.3
SLACK_S = 1.0


def silent_config(listener: SilentListener) -> TQConfig:
    return TQConfig(
        url=f"redis://{listener.address}/0",
        partitions=[],
        socket_timeout_s=TIMEOUT_S,
        connect_timeout_s=TIMEOUT_S,
    )


def test_both_redis_clients_take_their_bounds_from_the_config() -> None:
    options = redis_options(
        TQConfig(socket_timeout_s=7, connect_timeout_s=2, health_check_interval_s=9)
    )
    assert options["socket_timeout"] == 7
    assert options["socket_connect_timeout"] == 2
    assert options["health_check_interval"] == 9


def test_the_queue_fails_a_command_to_a_silent_redis_within_its_socket_timeout() -> None:
    with SilentListener() as listener:
        tq = TransferQueue.from_config(silent_config(listener))
        start = time.monotonic()
        with pytest.raises(TQUnavailableError):
            tq.partitions()
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        tq.close()


def test_the_async_queue_fails_a_command_to_a_silent_redis_within_its_socket_timeout() -> None:
    async def scenario(tq: AsyncTransferQueue) -> None:
        start = time.monotonic()
        with pytest.raises(TQUnavailableError):
            await tq.partitions()
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        consumer = AsyncEventConsumer(tq, "train", group="g", reader="r")
        with pytest.raises(TQUnavailableError):
            await consumer.create_group()
        await tq.aclose()

    with SilentListener() as listener:
        asyncio.run(scenario(AsyncTransferQueue.from_config(silent_config(listener))))


def test_the_reward_quota_store_fails_on_a_silent_redis_within_the_socket_timeout() -> None:
    from relayrl.reward.quotas import Demand, QuotaStoreUnavailable, RedisQuotas

    async def scenario(quotas: RedisQuotas) -> None:
        with pytest.raises(QuotaStoreUnavailable):
            await quotas.take("tenant", [Demand("rpm", capacity=10, amount=1)])

    with SilentListener() as listener:
        start = time.monotonic()
        asyncio.run(scenario(RedisQuotas(silent_config(listener))))
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S


def test_a_blocking_read_must_end_before_the_socket_timeout() -> None:
    config = TQConfig(url="redis://127.0.0.1:1/0", partitions=[])
    tq = TransferQueue.from_config(config)
    with pytest.raises(InvalidInputError, match="socket_timeout_s"):
        tq.follow_events("train", "$", block_ms=30_000)  # refused before any I/O

    async def scenario(tq: AsyncTransferQueue) -> None:
        with pytest.raises(InvalidInputError, match="socket_timeout_s"):
            await tq.follow_events("train", "$", block_ms=30_000)
        consumer = AsyncEventConsumer(tq, "train", group="g", reader="r")
        with pytest.raises(InvalidInputError, match="socket_timeout_s"):
            await consumer.read(block_s=30.0)

    asyncio.run(scenario(AsyncTransferQueue.from_config(config)))
