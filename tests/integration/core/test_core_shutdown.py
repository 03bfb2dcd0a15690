"""Graceful shutdown of a real service process: SIGTERM → health NOT_SERVING → no new calls →
in-flight calls finish within the grace period → shutdown hooks → exit 0."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.core.grpc_client import make_channel

HELPER = "relayrl_testkit.helpers.shutdown_server"
SERVICE = "relayrl.coretest.v1.Shutdown"
WAIT_S = 60.0  # bound on waiting for the helper to react; generous for a shared machine


class ServerProcess:
    """The helper process, tracked by PID, with its stdout lines readable without blocking
    forever (a reader thread feeds a queue)."""

    def __init__(self, grace_s: float, stderr_path: Path) -> None:
        self._stderr = stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", HELPER, str(grace_s)],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for_line(self, prefix: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"helper never printed {prefix!r}; saw {self.seen}") from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def drain(self) -> list[str]:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.seen

    def terminate(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._stderr.close()


StartServer = Callable[[float], tuple["ServerProcess", int]]


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """Starts helper processes (returning each with its port) and kills them by PID after."""
    started: list[ServerProcess] = []

    def start(grace_s: float) -> tuple[ServerProcess, int]:
        server = ServerProcess(grace_s, tmp_path / f"server-{len(started)}.stderr")
        started.append(server)
        return server, int(server.wait_for_line("port ").split()[1])

    yield start
    for server in started:
        server.kill()


async def until_rejected(target: str, method: str) -> grpc.StatusCode:
    """Call `method` on fresh channels until a call fails; return that failure's code."""
    for _ in range(int(WAIT_S / 0.05)):
        async with make_channel(target, default_timeout_s=5.0) as channel:
            try:
                await channel.unary_unary(method)(b"")
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{method} was still accepted {WAIT_S} s after SIGTERM")


def test_sigterm_drains_in_flight_call_then_runs_hooks_and_exits_zero(
    start_server: StartServer, tmp_path: Path
) -> None:
    server, port = start_server(WAIT_S)
    target = f"127.0.0.1:{port}"
    release = tmp_path / "release"

    async def scenario() -> None:
        async with make_channel(target, default_timeout_s=WAIT_S) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            in_flight = asyncio.ensure_future(
                channel.unary_unary(f"/{SERVICE}/Hold")(str(release).encode())
            )
            await asyncio.to_thread(server.wait_for_line, "slow call started")
            server.terminate()

            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()  # an open Watch would otherwise hold shutdown for the whole grace
            code = await until_rejected(target, f"/{SERVICE}/Echo")
            assert code is grpc.StatusCode.UNAVAILABLE
            assert not in_flight.done(), "the in-flight call ended before it was released"

            release.touch()
            assert await in_flight == b"released"

    asyncio.run(scenario())
    assert server.proc.wait(timeout=WAIT_S) == 0
    lines = server.drain()
    assert lines.index("shutdown hook ran") < lines.index("exiting")


def test_in_flight_call_longer_than_grace_is_cancelled_and_process_still_exits_zero(
    start_server: StartServer, tmp_path: Path
) -> None:
    server, port = start_server(0.5)

    async def scenario() -> grpc.StatusCode:
        async with make_channel(f"127.0.0.1:{port}", default_timeout_s=WAIT_S) as channel:
            never_released = str(tmp_path / "never").encode()
            in_flight = asyncio.ensure_future(
                channel.unary_unary(f"/{SERVICE}/Hold")(never_released)
            )
            await asyncio.to_thread(server.wait_for_line, "slow call started")
            server.terminate()
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await in_flight
            return cut.value.code()

    # gRPC cancels calls still running at the end of the grace period.
    assert asyncio.run(scenario()) in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert server.proc.wait(timeout=WAIT_S) == 0
    assert "shutdown hook ran" in server.drain()


def test_sigterm_when_idle_exits_zero_after_hooks(start_server: StartServer) -> None:
    server, _ = start_server(5.0)
    server.terminate()
    assert server.proc.wait(timeout=WAIT_S) == 0
    assert server.wait_for_line("shutdown hook ran") == "shutdown hook ran"
