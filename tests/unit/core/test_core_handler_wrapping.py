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
    assert wrapped.request_deserializer is _identity
    assert wrapped.response_serializer is _identity

    async def invoke() -> list[bytes]:
        result = getattr(wrapped, attr)(b"x", None)
        if handler.response_streaming:
            return [item async for item in result]
        return [await result]

    assert asyncio.run(invoke()) == [b"x"]
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
