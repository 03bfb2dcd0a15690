"""EndpointSlice discovery with the real `kubernetes` client against a local HTTP server that
speaks the API server's list and watch protocol for EndpointSlices (no cluster runs here):
ready endpoints join the pool, ones that stop being ready or disappear leave it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from relayrl.core.ports import free_port
from relayrl.gateway.config import KubernetesDiscoveryConfig
from relayrl.gateway.discovery import EndpointSliceDiscovery, endpoint_urls
from relayrl.gateway.replicas import ReplicaPool

NS, SERVICE = "rl", "engines"


def endpoint_slice(name: str, port: int, endpoints: list[tuple[str, str, bool]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": "1",
            "labels": {"kubernetes.io/service-name": SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NS},
            }
            for pod, address, ready in endpoints
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


class FakeApiServer:
    """List and watch of EndpointSlices in one namespace; the test pushes watch events."""

    def __init__(self, slices: list[dict]) -> None:
        self.slices = {s["metadata"]["name"]: s for s in slices}
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._events: asyncio.Queue[dict] | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()
        self.requests: list[str] = []

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._events = asyncio.Queue()
        app = web.Application()
        app.router.add_get(
            f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", self._endpointslices
        )
        runner = self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.query_string)
        assert request.query.get("labelSelector") == f"kubernetes.io/service-name={SERVICE}"
        if request.query.get("watch") not in ("true", "1", "True"):
            return web.json_response(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": "1"},
                    "items": list(self.slices.values()),
                }
            )
        response = web.StreamResponse()
        await response.prepare(request)
        assert self._events is not None
        while True:
            event = await self._events.get()
            await response.write(json.dumps(event).encode() + b"\n")

    def start(self) -> FakeApiServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def push(self, kind: str, eps: dict) -> None:
        name = eps["metadata"]["name"]
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = eps
        assert self._events is not None
        self._loop.call_soon_threadsafe(self._events.put_nowait, {"type": kind, "object": eps})

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def stop(self) -> None:
        # End the open watch streams first, so no handler outlives the loop.
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def closed_port() -> int:
    return free_port()  # nothing listens: health checks fail at once


@pytest.fixture
def api(closed_port: int) -> Iterator[FakeApiServer]:
    server = FakeApiServer(
        [
            endpoint_slice(
                "engines-a",
                closed_port,
                [("engine-0", "127.0.0.2", True), ("engine-1", "127.0.0.3", False)],
            )
        ]
    ).start()
    try:
        yield server
    finally:
        server.stop()


async def eventually(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_ready_endpoints_join_and_leave_the_pool(api: FakeApiServer, closed_port: int) -> None:
    async def scenario() -> None:
        pool = ReplicaPool(health_interval_s=60)
        config = KubernetesDiscoveryConfig(
            service=SERVICE, namespace=NS, api_host=f"http://127.0.0.1:{api.port}"
        )
        discovery = EndpointSliceDiscovery(pool, config)
        discovery.start()
        try:
            await eventually(lambda: [r.replica_id for r in pool.replicas] == ["engine-0"])
            (replica,) = pool.replicas
            assert replica.source == "endpointslice"
            assert replica.client.base_url == f"http://127.0.0.2:{closed_port}"  # type: ignore[attr-defined]
            api.push(
                "MODIFIED",
                endpoint_slice(
                    "engines-a",
                    closed_port,
                    [("engine-0", "127.0.0.2", False), ("engine-1", "127.0.0.3", True)],
                ),
            )
            await eventually(lambda: [r.replica_id for r in pool.replicas] == ["engine-1"])
            api.push(
                "ADDED",
                endpoint_slice("engines-b", closed_port, [("engine-2", "127.0.0.4", True)]),
            )
            await eventually(lambda: sorted(discovery.known) == ["engine-1", "engine-2"])
            api.push("DELETED", api.slices["engines-a"])
            await eventually(lambda: [r.replica_id for r in pool.replicas] == ["engine-2"])
        finally:
            await discovery.close()
            await pool.close()
        assert any("watch=true" in q.lower() for q in api.requests)

    asyncio.run(scenario())


def test_endpoint_urls_pick_the_named_port_and_skip_unready() -> None:
    eps: dict[str, Any] = endpoint_slice(
        "s", 8000, [("p0", "10.0.0.1", True), ("p1", "10.0.0.2", False)]
    )
    eps["ports"].insert(0, {"name": "metrics", "port": 9100})
    assert endpoint_urls([eps], "http", "http") == {"p0": "http://10.0.0.1:8000"}
    assert endpoint_urls([eps], None, "https") == {"p0": "https://10.0.0.1:9100"}
    eps["endpoints"][0].pop("targetRef")
    eps["endpoints"][0]["addresses"] = ["fd00::1"]
    assert endpoint_urls([eps], "http", "http") == {"fd00::1": "http://[fd00::1]:8000"}
