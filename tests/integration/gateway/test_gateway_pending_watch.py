"""The gateway's claim loop is woken by the TransferQueue the moment a group becomes pending, and
its watcher outlives a Redis that goes away (the loop's poll covers for it meanwhile). A real
redis-server, no engine."""

from __future__ import annotations

import asyncio
import time

from relayrl.gateway.rollout import WATCH_BLOCK_MS, _PendingWatcher
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import AsyncTransferQueue, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.queues import run_with_async_queue

P = "train"


def group(uid: str) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(uid=uid, num_samples=1, prompt_token_ids=[1, 2])


async def woken(wake: asyncio.Event, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(wake.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


def test_a_pending_group_wakes_the_claim_loop_and_other_transitions_do_not(
    tq: TransferQueue, redis_server: RedisServer
) -> None:
    async def main(atq: AsyncTransferQueue) -> None:
        wake = asyncio.Event()
        watcher = _PendingWatcher(atq, P, wake)
        watcher.start()
        try:
            await asyncio.sleep(0.2)  # blocked on the stream by now
            await atq.put_groups(P, [group("a")])
            started = time.monotonic()
            assert await woken(wake, 5.0)
            assert time.monotonic() - started < WATCH_BLOCK_MS / 1000  # not a poll's wait
            wake.clear()
            await atq.claim_groups(P, max_groups=1, claimer="w", lease_s=60)
            assert not await woken(wake, 0.5)  # pending -> running wakes no one
            tq.put_groups("val", [group("v")])  # the sync client, on the same keys
            assert not await woken(wake, 0.3)  # another partition's work
            tq.put_groups(P, [group("b")])
            assert await woken(wake, 5.0)
        finally:
            await watcher.close()  # at once, though the watcher is blocked in a read

    run_with_async_queue(redis_server, main)


def test_the_watcher_survives_redis_going_away(redis_server: RedisServer) -> None:
    async def main(tq: AsyncTransferQueue) -> None:
        await tq.create_partition(P)
        wake = asyncio.Event()
        watcher = _PendingWatcher(tq, P, wake)
        watcher.start()
        try:
            await asyncio.sleep(0.2)
            redis_server.kill()
            await asyncio.sleep(1.5)  # its reads fail now; it waits and tries again
            assert watcher._task is not None and not watcher._task.done()
            assert not wake.is_set()
        finally:
            await watcher.close()
        assert watcher._task.done()

    run_with_async_queue(redis_server, main, socket_connect_timeout=0.5)
