"""Running the TransferQueue's operations (relayrl.tq.steps) on a Redis connection.

`SyncRunner` runs them over `redis.Redis` (the trainer, the CLI, audits), `AsyncRunner` over
`redis.asyncio.Redis` (the gateway and the reward-service, on their event loop). A runner only
sends each step's I/O and hands the reply, or the error, back to the operation: the checks,
the arguments and the decoding are the operation's, once for both."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

import redis
import redis.asyncio as aioredis

from relayrl.tq.base import unavailable_as_tq_error
from relayrl.tq.scripts import load_scripts
from relayrl.tq.steps import Step, Steps

R = TypeVar("R")


class Drive(Generic[R]):
    """Advances one operation: the next step it needs, given the last one's reply or error."""

    __slots__ = ("_error", "_steps", "reply", "result")

    def __init__(self, steps: Steps[R]) -> None:
        self._steps = steps
        self._error: Exception | None = None
        self.reply: Any = None
        self.result: R

    def next(self) -> Step | None:
        """The next step, or None once the operation returned (its value is `result`); an
        error the operation does not handle propagates from here."""
        try:
            if self._error is None:
                return self._steps.send(self.reply)
            error, self._error = self._error, None
            return self._steps.throw(error)
        except StopIteration as done:
            self.result = done.value
            return None

    @contextlib.contextmanager
    def answer(self, step: Step) -> Iterator[None]:
        """Around a step's I/O, which sets `reply`: what failed goes to the operation, raised
        at its `yield` (a lost connection as TQUnavailableError, a script's error reply as its
        TQ exception), where it propagates unless the operation expects it."""
        try:
            with unavailable_as_tq_error():
                yield
            self.reply = step.received(self.reply)
        except redis.ResponseError as exc:
            self._error = step.translated(exc)
        except Exception as exc:  # not hidden: the operation re-raises what it does not handle
            self._error = exc


class SyncRunner:
    """Runs operations over `redis.Redis`: a call returns when Redis has answered."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.scripts = load_scripts(client)

    def run(self, steps: Steps[R]) -> R:
        drive = Drive(steps)
        while (step := drive.next()) is not None:
            with drive.answer(step):
                drive.reply = step.send(self.client, self.scripts)
        return drive.result


class AsyncRunner:
    """Runs operations over `redis.asyncio.Redis`: a call is a coroutine. Each command takes a
    pooled connection for its duration, so a blocking read waits on a connection of its own
    while the others go on."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.scripts = load_scripts(client)

    async def run(self, steps: Steps[R]) -> R:
        task = asyncio.current_task()
        assert task is not None, "an AsyncTransferQueue operation runs in a task"
        drive = Drive(steps)
        while (step := drive.next()) is not None:
            cancels = task.cancelling()
            with drive.answer(step):
                drive.reply = await step.send(self.client, self.scripts)
            if task.cancelling() > cancels:
                # Cancelled during the step, which still returned: Python 3.11's
                # asyncio.wait_for, which redis.asyncio sends a command under (its socket
                # timeout), drops a cancellation that lands as the send completes. Raised here,
                # as it would have been, or a cancelled loop would go on for ever.
                raise asyncio.CancelledError
        return drive.result


class SyncSide(Protocol):
    """A client whose operations run at once (relayrl.tq.steps.SyncOperation)."""

    _runner: SyncRunner


class AsyncSide(Protocol):
    """A client whose operations are coroutines (relayrl.tq.steps.AsyncOperation)."""

    _runner: AsyncRunner
