"""Peers that go silent, on loopback: what a client sees of a partition or a half-open
connection, for the tests of docs/recovery.md#silent-peers.

- `SilentListener`: a port whose kernel completes every handshake and whose process never
  reads or answers a byte (a peer that hangs, or a flow whose answers are lost).
- `BlackHoleProxy`: a TCP proxy in front of a real server that forwards both ways until
  `go_silent()`, and from then on keeps every connection open and drops whatever arrives
  (a partition that opens under an established connection: nothing is reset or closed).

Both run on daemon threads and are stopped by `close()` (or leaving the `with` block).
`held_http_server` keeps an HTTP client's connection open (a response whose body never
comes) so that a test can read the options of the client's socket
(`keepalive_options_of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

_POLL_S = 0.05


class _Acceptor:
    """Accepts connections on a loopback port on a thread; `serve(conn)` handles each."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=type(self).__name__, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._keep(conn)
            self.serve(conn)

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def serve(self, conn: socket.socket) -> None:
        """Handle one accepted connection (on the accepting thread: start threads for more)."""

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SilentListener(_Acceptor):
    """Accepts, then never reads or writes: every request to it waits for an answer."""


class BlackHoleProxy(_Acceptor):
    """Forwards each connection to `upstream_port` until `go_silent()`; then drops every byte
    in both directions and closes nothing."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._silent = threading.Event()
        super().__init__()

    def go_silent(self) -> None:
        self._silent.set()

    def serve(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self._upstream_port), timeout=5)
        self._keep(upstream)
        for source, sink in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        source.settimeout(_POLL_S)
        while not self._stopped.is_set():
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                if not self._silent.is_set():  # a close passes while the link is up
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                return
            if self._silent.is_set():
                continue  # read and dropped: the far side never sees it, nothing is reset
            try:
                sink.sendall(data)
            except OSError:
                return


@contextlib.asynccontextmanager
async def held_http_server() -> AsyncIterator[str]:
    """The base URL of an HTTP server that answers every request with the head of a 200 and
    holds its body back until the client goes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def keepalive_options_of(sock: socket.socket) -> dict[str, int]:
    """The keepalive options a connected socket carries (Linux names)."""
    return {
        name: sock.getsockopt(level, getattr(socket, name))
        for level, name in (
            (socket.SOL_SOCKET, "SO_KEEPALIVE"),
            (socket.IPPROTO_TCP, "TCP_KEEPIDLE"),
            (socket.IPPROTO_TCP, "TCP_KEEPINTVL"),
            (socket.IPPROTO_TCP, "TCP_KEEPCNT"),
            (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT"),
        )
    }
