"""An AsyncTransferQueue for a test: the asyncio client belongs to the event loop it is used
in, so a test runs its scenario in a loop of its own with a queue made and closed there."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from relayrl.tq import AsyncTransferQueue
from relayrl.tq.server import RedisServer

T = TypeVar("T")


def run_with_async_queue(
    server: RedisServer, main: Callable[[AsyncTransferQueue], Awaitable[T]], **options: Any
) -> T:
    """`main` run to its end on an AsyncTransferQueue of `server` (redis.asyncio `options`
    such as socket_timeout), closed after."""

    async def run() -> T:
        async with AsyncTransferQueue(server.async_client(**options)) as tq:
            return await main(tq)

    return asyncio.run(run())
