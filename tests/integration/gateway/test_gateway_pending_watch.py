"""The gateway's claim loop is woken by the TransferQueue the moment a group becomes pending, and
its watcher outlives a Redis that goes away (the loop's poll covers for it meanwhile). A real
redis-server, no engine."""

from __future__ import annotations

import asyncio
import time

from relayrl.gateway.rollout import WATCH_BLOCK_MS, _PendingWatcher
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer

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
    tq: TransferQueue,
) -> None:
    async def main() -> None:
        wake = asyncio.Event()
        watcher = _PendingWatcher(tq, P, wake)
        watcher.start()
        try:
            await asyncio.sleep(0.2)  # blocked on the stream by now
            tq.put_groups(P, [group("a")])
            started = time.monotonic()
            assert await woken(wake, 5.0)
            assert time.monotonic() - started < WATCH_BLOCK_MS / 1000  # not a poll's wait
            wake.clear()
            await asyncio.to_thread(tq.claim_groups, P, max_groups=1, claimer="w", lease_s=60)
            assert not await woken(wake, 0.5)  # pending -> running wakes no one
            tq.put_groups("val", [group("v")])
            assert not await woken(wake, 0.3)  # another partition's work
            tq.put_groups(P, [group("b")])
            assert await woken(wake, 5.0)
        finally:
            watcher.stop()

    asyncio.run(main())


def test_the_watcher_survives_redis_going_away(redis_server: RedisServer) -> None:
    tq = TransferQueue(redis_server.client(socket_connect_timeout=0.5))
    tq.create_partition(P)

    async def main() -> None:
        wake = asyncio.Event()
        watcher = _PendingWatcher(tq, P, wake)
        watcher.start()
        try:
            await asyncio.sleep(0.2)
            redis_server.kill()
            await asyncio.sleep(1.5)  # its reads fail now; it waits and tries again
            assert watcher._thread.is_alive()
            assert not wake.is_set()
        finally:
            watcher.stop()
            watcher._thread.join(5)
        assert not watcher._thread.is_alive()

    try:
        asyncio.run(main())
    finally:
        tq.close()
