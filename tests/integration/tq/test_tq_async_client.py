"""AsyncTransferQueue and AsyncEventConsumer, the services' asyncio clients, against a real
redis-server: the same operations as the sync clients on the same keys, the same errors for
the same mistakes, the same bounds on a blocking read, and a consumer group that reclaims and
dead-letters as EventConsumer's does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    AsyncEventConsumer,
    AsyncTransferQueue,
    ConflictError,
    EventConsumer,
    IllegalTransitionError,
    TQConfig,
    TQUnavailableError,
    TrajectoryPut,
    TransferQueue,
)
from relayrl.tq.errors import (
    InvalidInputError,
    StaleClaimError,
    UnknownKeyError,
    UnknownPartitionError,
)
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.queues import run_with_async_queue

P = "train"
FINISHED = {("trajectory", "finished")}


def group(uid: str, n: int = 2, step: int = 0) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(uid=uid, num_samples=n, prompt_token_ids=[1, 2], prompt_step=step)


def put(uid: str, index: int, claim_id: str) -> TrajectoryPut:
    trajectory = common_pb2.Trajectory(
        uid=uid, index=index, response_token_ids=[5, 6], response_mask=b"\x01\x01"
    )
    return TrajectoryPut(trajectory, claim_id)


def reward(score: float) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(status=common_pb2.REWARD_STATUS_OK, score=score)


def test_the_two_clients_share_one_queue(tq: TransferQueue, redis_server: RedisServer) -> None:
    """A group put by one client is claimed, written and scored through the other, and each
    reads what the other wrote: one key layout, one state machine."""
    tq.put_groups(P, [group("sync-put", step=1)])

    async def main(atq: AsyncTransferQueue) -> str:
        assert await atq.partitions() == ["train", "val"]
        (claim,) = (await atq.claim_groups(P, max_groups=5, claimer="a", lease_s=60)).claimed
        assert (claim.group.uid, claim.group.prompt_step) == ("sync-put", 1)
        await atq.put_trajectories(P, [put("sync-put", 0, claim.claim_id)])
        await atq.put_groups(P, [group("async-put")])
        assert await atq.leases(P) == tq.leases(P)
        return claim.claim_id

    claim_id = run_with_async_queue(redis_server, main)
    (mine,) = tq.claim_groups(P, max_groups=5, claimer="s", lease_s=60).claimed
    assert mine.group.uid == "async-put"
    (entry,) = tq.get_groups(P, ["sync-put"])
    assert [t.index for t in entry.trajectories] == [0]
    tq.renew_leases(P, {"sync-put": claim_id}, 60)  # the claim made through the other holds

    async def inspect(atq: AsyncTransferQueue) -> None:
        assert await atq.counts(P) == tq.counts(P)
        assert await atq.last_events(P, 50) == tq.last_events(P, 50)
        assert await atq.audit_snapshot(P) == tq.audit_snapshot(P)
        assert await atq.staleness(P, 3) == tq.staleness(P, 3)
        assert await atq.group_uids(P) == tq.group_uids(P) == ["async-put", "sync-put"]

    run_with_async_queue(redis_server, inspect)


# (operation, args, kwargs, the error) on the queue of `refused_calls_queue`
REFUSED: list[tuple[str, tuple[Any, ...], dict[str, Any], type[Exception]]] = [
    ("put_groups", ("nope", [group("x")]), {}, UnknownPartitionError),
    ("put_groups", (P, [group("g", n=3)]), {}, ConflictError),
    ("renew_leases", (P, {"g": "not-the-claim"}, 60), {}, StaleClaimError),
    ("release_groups", (P, {"g": "not-the-claim"}), {}, StaleClaimError),
    ("drop_groups", (P, ["g"], "stale"), {}, IllegalTransitionError),
    ("put_trajectories", (P, [put("g", 5, "c1")]), {}, InvalidInputError),
    ("get_groups", (P, ["missing"]), {}, UnknownKeyError),
    ("claim_groups", (P,), {"max_groups": 1, "claimer": "", "lease_s": 60}, InvalidInputError),
    ("consume", (P, -1, 1), {}, InvalidInputError),
    ("follow_events", (P, "$"), {"block_ms": 30_000}, InvalidInputError),
]


@pytest.mark.parametrize(
    ("operation", "args", "kwargs", "error"),
    REFUSED,
    ids=[f"{operation}-{error.__name__}" for operation, _, _, error in REFUSED],
)
def test_both_clients_refuse_a_mistake_with_the_same_error(
    tq: TransferQueue,
    redis_server: RedisServer,
    operation: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
) -> None:
    tq.put_groups(P, [group("g")])
    tq.claim_groups(P, max_groups=1, claimer="t", lease_s=60)
    with pytest.raises(error) as refused:
        getattr(tq, operation)(*args, **kwargs)

    async def main(atq: AsyncTransferQueue) -> None:
        with pytest.raises(error) as also_refused:
            await getattr(atq, operation)(*args, **kwargs)
        assert str(also_refused.value) == str(refused.value)
        assert type(also_refused.value) is type(refused.value)

    # a 5 s socket timeout, as the sync client of the fixture has: the 30 s block is refused
    run_with_async_queue(redis_server, main, socket_timeout=5)


def test_a_blocking_read_must_end_before_the_socket_timeout(redis_server: RedisServer) -> None:
    async def main(atq: AsyncTransferQueue) -> None:
        await atq.create_partition(P)
        with pytest.raises(InvalidInputError, match="socket_timeout_s is 1 s"):
            await atq.wait_for_pending(P, block_ms=1000)
        consumer = AsyncEventConsumer(atq, P, group="g", reader="r")
        await consumer.create_group()
        with pytest.raises(InvalidInputError, match="socket_timeout_s"):
            await consumer.read(block_s=2.0)
        started = time.monotonic()
        assert await atq.wait_for_pending(P, "$", block_ms=300) == ("$", False)  # below: fine
        assert time.monotonic() - started >= 0.25

    run_with_async_queue(redis_server, main, socket_timeout=1)


def test_an_unreachable_redis_is_unavailable_within_the_connect_timeout() -> None:
    config = TQConfig(url="redis://127.0.0.1:1/0", partitions=[], connect_timeout_s=0.5)

    async def main() -> None:
        async with AsyncTransferQueue.from_config(config) as atq:
            started = time.monotonic()
            with pytest.raises(TQUnavailableError, match="unavailable"):
                await atq.claim_groups(P, max_groups=1, claimer="c", lease_s=60)
            assert time.monotonic() - started < 0.5 + 1.0

    asyncio.run(main())


def connection_of(client: Any) -> Any:
    """A connection as the client's pool makes them (not connected)."""
    pool = client.connection_pool
    return pool.connection_class(**pool.connection_kwargs)


def test_from_config_builds_the_client_the_sync_one_builds() -> None:
    config = TQConfig(
        partitions=[], socket_timeout_s=7, connect_timeout_s=2, health_check_interval_s=9
    )
    sync = connection_of(TransferQueue.from_config(config).redis)
    aio = connection_of(AsyncTransferQueue.from_config(config).redis)
    for option in (
        "socket_timeout",
        "socket_connect_timeout",
        "health_check_interval",
        "socket_keepalive",
        "socket_keepalive_options",
        "password",
        "db",
    ):
        assert getattr(aio, option) == getattr(sync, option), option
    assert (aio.socket_timeout, aio.health_check_interval, aio.socket_keepalive) == (7, 9, True)
    # no automatic retries on either: a retried claim_groups would claim a second batch
    assert aio.retry.get_retries() == sync.retry.get_retries() == 0
    with pytest.raises(InvalidInputError, match="partitions=\\[\\]"):
        AsyncTransferQueue.from_config(TQConfig(partitions=["train"]))


def test_the_async_client_opens_at_most_max_connections(redis_server: RedisServer) -> None:
    """A blocking read holds its connection for its block: with a cap of two and two reads
    blocking, a third command waits for one of them to end instead of opening a third."""
    config = TQConfig(url=redis_server.url, partitions=[], max_connections=2, socket_timeout_s=3)

    async def main() -> float:
        async with AsyncTransferQueue.from_config(config) as atq:
            await atq.create_partition(P)
            reads = [atq.wait_for_pending(P, "$", block_ms=1500) for _ in "ab"]
            blocking = [asyncio.create_task(read) for read in reads]
            await asyncio.sleep(0.3)
            started = time.monotonic()
            assert await atq.partitions() == [P]
            waited = time.monotonic() - started
            await asyncio.gather(*blocking)
            return waited

    assert asyncio.run(main()) > 0.8  # the reads' block, less the 0.3 s before it asked


def test_the_async_consumer_reads_acks_reclaims_and_dead_letters(
    tq: TransferQueue, redis_server: RedisServer
) -> None:
    """Reader a takes the events and dies without acking; reader b reclaims them once idle;
    an event delivered max_deliveries times goes to the dead letters, whence a redrive brings
    it back. Unwanted events are acknowledged as they are read."""
    tq.put_groups(P, [group("g", n=3)])
    (claim,) = tq.claim_groups(P, max_groups=1, claimer="gw", lease_s=60).claimed
    tq.put_trajectories(P, [put("g", i, claim.claim_id) for i in range(3)])

    async def main(atq: AsyncTransferQueue) -> None:
        def reader(name: str) -> AsyncEventConsumer:
            return AsyncEventConsumer(
                atq, P, group="reward", reader=name, wants=FINISHED,
                reclaim_idle_s=0.2, max_deliveries=2,
            )  # fmt: skip

        a, b = reader("a"), reader("b")
        await a.create_group()
        await b.create_group()  # it exists: nothing happens
        first = await a.read(count=10, block_s=0.1)
        assert sorted(e.key for e in first) == ["g_0", "g_1", "g_2"]
        assert {e.deliveries for e in first} == {1}
        assert await a.pending_count() == 3  # the group transitions were acked unread
        assert await b.read(count=10, block_s=0.1) == []  # not idle long enough yet
        await asyncio.sleep(0.3)
        second = await b.read(count=10, block_s=0.1)
        assert sorted(e.key for e in second) == ["g_0", "g_1", "g_2"]
        assert {e.deliveries for e in second} == {2}
        assert await b.ack([e for e in second if e.key == "g_0"]) == 1
        await asyncio.sleep(0.3)
        assert await a.read(count=10, block_s=0.1) == []  # the other two: delivered twice
        dead = await a.dead_letters()
        assert sorted(e.key for e in dead) == ["g_1", "g_2"]
        assert {e.extra["dead_group"] for e in dead} == {"reward"}
        assert await a.pending_count() == 0
        assert len(await atq.redrive_dead_letters(P)) == 2
        again = await b.read(count=10, block_s=0.1)
        assert sorted(e.key for e in again) == ["g_1", "g_2"]
        await b.ack(again)

    run_with_async_queue(redis_server, main)
    # the sync consumer of the same group sees the same state
    consumer = EventConsumer(tq, P, group="reward", reader="c", wants=FINISHED)
    assert consumer.pending_count() == 0 and consumer.dead_letters() == []
    assert tq.num_dead_letters(P) == 0


def test_a_task_cancelled_as_its_blocking_read_starts_ends(redis_server: RedisServer) -> None:
    """The cancellation lands as the next read is sent (Python 3.11's wait_for, under which
    redis.asyncio sends, would drop it): the reading task still ends."""

    async def main(atq: AsyncTransferQueue) -> None:
        await atq.create_partition(P)
        woken = asyncio.Event()

        async def watch() -> None:
            last_id = "$"
            while True:
                last_id, pending = await atq.wait_for_pending(P, last_id, block_ms=1000)
                if pending:
                    woken.set()

        for attempt in range(5):
            watcher = asyncio.create_task(watch())
            await asyncio.sleep(0.1)
            await atq.put_groups(P, [group(f"g{attempt}")])
            await woken.wait()
            woken.clear()
            watcher.cancel()
            done, _ = await asyncio.wait([watcher], timeout=3)
            assert done, f"attempt {attempt}: the cancelled watcher goes on"
            assert watcher.cancelled()

    run_with_async_queue(redis_server, main)


@pytest.mark.parametrize(
    "call",
    [
        lambda atq: atq.claim_groups(P, max_groups=1, claimer="c", lease_s=60),
        lambda atq: AsyncEventConsumer(atq, P, group="g", reader="r").create_group(),
    ],
    ids=["queue", "consumer"],
)
def test_a_redis_that_went_away_is_unavailable(
    redis_server: RedisServer, call: Callable[[AsyncTransferQueue], Any]
) -> None:
    async def main(atq: AsyncTransferQueue) -> None:
        await atq.create_partition(P)
        redis_server.kill()
        with pytest.raises(TQUnavailableError):
            await call(atq)

    run_with_async_queue(redis_server, main, socket_connect_timeout=0.5)


def test_a_read_keeps_its_events_when_redis_stops_before_the_unwanted_ones_are_acked(
    tmp_path: Path,
) -> None:
    """A read takes the trajectories with the group transitions around them, and Redis stops
    before it has acknowledged the unwanted group transitions: the read still returns the
    trajectories (raising would leave them delivered to this reader, unseen, pending until a
    reclaim) and they are acknowledged once Redis is back; the group transitions stay pending
    until a reclaim acknowledges them."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        tq = TransferQueue(server.client())
        tq.create_partition(P)
        tq.put_groups(P, [group("g")])
        (claim,) = tq.claim_groups(P, max_groups=1, claimer="gw", lease_s=60).claimed
        tq.put_trajectories(P, [put("g", i, claim.claim_id) for i in range(2)])
        tq.close()

        async def main() -> None:
            client = server.async_client()
            ack = client.xack

            async def stop_then_ack(*args: Any, **kwargs: Any) -> Any:
                client.xack = ack  # once
                server.stop()
                return await ack(*args, **kwargs)

            client.xack = stop_then_ack
            async with AsyncTransferQueue(client) as atq:
                consumer = AsyncEventConsumer(
                    atq, P, group="reward", reader="r", wants=FINISHED, reclaim_idle_s=0.2
                )
                await consumer.create_group()
                events = await consumer.read(count=10, block_s=0.1)
                assert sorted(e.key for e in events) == ["g_0", "g_1"]
                server.start()
                assert await consumer.ack(events) == 2
                assert await consumer.pending_count() == 3  # the group's pending, running, finished
                await asyncio.sleep(0.3)
                assert await consumer.read(count=10, block_s=0.1) == []
                assert await consumer.pending_count() == 0

        asyncio.run(main())
    finally:
        server.kill()
