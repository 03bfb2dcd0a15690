"""The generic handler wrapper and the status classification behind logs and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NamedTuple

import grpc
import pytest

from relayrl.core.interceptors import wrap_handler


class Details(NamedTuple):
    """The two fields of grpc.HandlerCallDetails that the wrapper reads."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...] = ()


def _identity(data: bytes) -> bytes:
    return data


async def _unary(request: bytes, context: object) -> bytes:
    return request


async def _streaming(request: bytes, context: object) -> AsyncIterator[bytes]:
    yield request


@pytest.mark.parametrize(
    ("factory", "attr", "behavior"),
    [
        (grpc.unary_unary_rpc_method_handler, "unary_unary", _unary),
        (grpc.unary_stream_rpc_method_handler, "unary_stream", _streaming),
        (grpc.stream_unary_rpc_method_handler, "stream_unary", _unary),
        (grpc.stream_stream_rpc_method_handler, "stream_stream", _streaming),
    ],
)
def test_wrapping_keeps_kind_and_serializers(factory, attr: str, behavior) -> None:
    entered: list[str] = []

    @asynccontextmanager
    async def scope(details: Details, context: object) -> AsyncIterator[None]:
        entered.append(details.method)
        yield

    handler = factory(behavior, request_deserializer=_identity, response_serializer=_identity)
    wrapped = wrap_handler(handler, Details("/a.B/C"), scope)
    assert (wrapped.request_streaming, wrapped.response_streaming) == (
        handler.request_streaming,
        handler.response_streaming,
    )
    assert wrapped.request_deserializer(b"y") == b"y"  # still the handler's own
    assert wrapped.response_serializer is _identity

    async def one_request() -> AsyncIterator[bytes]:
        yield b"x"

    async def invoke() -> list[object]:
        request = one_request() if handler.request_streaming else b"x"
        result = getattr(wrapped, attr)(request, None)
        outputs = [item async for item in result] if handler.response_streaming else [await result]
        if handler.request_streaming:  # the behaviours echo their request: here, the stream
            return [[message async for message in output] for output in outputs]
        return outputs

    expected = [[b"x"]] if handler.request_streaming else [b"x"]
    assert asyncio.run(invoke()) == expected
    assert entered == ["/a.B/C"]


def test_sync_handlers_are_refused_rather_than_left_unwrapped() -> None:
    @asynccontextmanager
    async def scope(details: Details, context: object) -> AsyncIterator[None]:
        yield

    def sync_handler(request: bytes, context: object) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(sync_handler)
    with pytest.raises(TypeError, match="synchronous"):
        wrap_handler(handler, Details("/a.B/C"), scope)


def test_a_request_that_does_not_parse_is_refused_as_invalid_argument() -> None:
    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(f"{code.name}: {details}")

    def strict(data: bytes) -> bytes:
        raise ValueError("wire format was corrupt")

    @asynccontextmanager
    async def scope(details: Details, context: object) -> AsyncIterator[None]:
        yield

    handler = grpc.unary_unary_rpc_method_handler(
        _unary, request_deserializer=strict, response_serializer=_identity
    )
    wrapped = wrap_handler(handler, Details("/a.B/C"), scope)
    request = wrapped.request_deserializer(b"\xff")
    with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT: /a\.B/C: the request is not"):
        asyncio.run(wrapped.unary_unary(request, Context()))
