"""The TransferQueue's operations, written once for its sync and its asyncio clients.

An operation is a generator method marked `@operation`: it checks its arguments, yields the
Redis work it needs as steps (a `Command`, a `Script`, a `Pipeline`), receives each reply (or
the error it became, raised at the `yield`), and returns the decoded result. It never touches a
connection. The client it is read from runs it: `TransferQueue` over `redis.Redis`, where a call
returns the result, and `AsyncTransferQueue` over `redis.asyncio.Redis`, where a call returns a
coroutine (relayrl.tq.runners). So validation, argument building and reply decoding exist once,
and only the runner differs. One operation runs another as part of itself with
`yield from self.other.steps(...)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import redis

from relayrl.tq.scripts import translate_error

if TYPE_CHECKING:
    from relayrl.tq.runners import AsyncSide, SyncSide

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Command:
    """One redis-py client method (`name`, e.g. "xread") with its arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def send(self, client: Any, scripts: Mapping[str, Any]) -> Any:
        return getattr(client, self.name)(*self.args, **self.kwargs)

    def received(self, reply: Any) -> Any:
        return reply

    def translated(self, error: redis.ResponseError) -> Exception:
        return error  # the operation may expect it (BUSYGROUP, a hidden CONFIG)


def command(name: str, *args: Any, **kwargs: Any) -> Command:
    return Command(name, args, kwargs)


@dataclass(frozen=True, slots=True)
class Script:
    """One of the queue's Lua scripts (relayrl.tq.scripts); its error reply becomes the TQ
    exception it names, about `partition`."""

    partition: str
    name: str
    keys: Sequence[str]
    argv: Sequence[Any]

    def send(self, client: Any, scripts: Mapping[str, Any]) -> Any:
        return scripts[self.name](keys=self.keys, args=self.argv)

    def queue(self, pipe: Any, scripts: Mapping[str, Any]) -> None:
        """Adds the script to `pipe` as redis-py's Script does for a pipeline (which loads it
        on execute when Redis lacks it), without that call: a coroutine on the asyncio client."""
        script = scripts[self.name]
        pipe.scripts.add(script)
        pipe.evalsha(script.sha, len(self.keys), *self.keys, *self.argv)

    def received(self, reply: Any) -> Any:
        return reply

    def translated(self, error: redis.ResponseError) -> Exception:
        return translate_error(self.partition, error)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Commands sent together (in one MULTI with `transaction`); their replies, or, with a
    script `then` queued last, the script's reply alone (the others' are dropped)."""

    commands: Sequence[Command]
    transaction: bool = False
    then: Script | None = None

    def send(self, client: Any, scripts: Mapping[str, Any]) -> Any:
        pipe = client.pipeline(transaction=self.transaction)
        for queued in self.commands:
            queued.send(pipe, scripts)
        if self.then is not None:
            self.then.queue(pipe, scripts)
        return pipe.execute(raise_on_error=self.then is None)

    def received(self, reply: list[Any]) -> Any:
        if self.then is None:
            return reply
        if isinstance(reply[-1], redis.ResponseError):
            raise reply[-1]
        return reply[-1]

    def translated(self, error: redis.ResponseError) -> Exception:
        return error if self.then is None else self.then.translated(error)


Step = Command | Script | Pipeline
# What an operation's generator is: it yields steps, is sent their replies, returns R.
Steps = Generator[Step, Any, R]


class Operation(Generic[P, R]):
    """An operation read from a client: calling it runs it on the client's connection;
    `steps(...)` gives its steps to another operation that runs it as part of its own."""

    __slots__ = ("_client", "_steps")

    def __init__(self, client: Any, steps: Callable[Concatenate[Any, P], Steps[R]]) -> None:
        self._client = client
        self._steps = steps

    def steps(self, *args: P.args, **kwargs: P.kwargs) -> Steps[R]:
        return self._steps(self._client, *args, **kwargs)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._client._runner.run(self._steps(self._client, *args, **kwargs))


class SyncOperation(Operation[P, R]):
    """An operation of a sync client: a call returns its result."""

    if TYPE_CHECKING:

        def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...


class AsyncOperation(Operation[P, R]):
    """An operation of an asyncio client: a call returns a coroutine of its result."""

    if TYPE_CHECKING:

        def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]: ...


class operation(Generic[P, R]):  # lower case: a decorator, like property
    """Marks a generator method as an operation of the queue (see the module's docstring)."""

    def __init__(self, steps: Callable[Concatenate[Any, P], Steps[R]]) -> None:
        self._steps = steps
        functools.update_wrapper(self, steps)

    @overload
    def __get__(self, client: None, owner: type | None = None) -> operation[P, R]: ...
    @overload
    def __get__(self, client: SyncSide, owner: type | None = None) -> SyncOperation[P, R]: ...
    @overload
    def __get__(self, client: AsyncSide, owner: type | None = None) -> AsyncOperation[P, R]: ...
    @overload
    def __get__(self, client: object, owner: type | None = None) -> Operation[P, R]: ...

    def __get__(self, client: object, owner: type | None = None) -> Any:
        if client is None:
            return self
        return Operation(client, self._steps)
