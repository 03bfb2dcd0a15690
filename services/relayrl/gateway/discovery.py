"""Engine replicas discovered from the EndpointSlices of a Kubernetes Service: list them, then
watch; a ready endpoint joins the replica pool, one that goes away or stops being ready leaves
it (its sessions move to other replicas on their next request).

The kubernetes client is synchronous; its list and watch calls run in a worker thread and
hand changes to the event loop. A watch that ends or fails (an API-server restart, an expired
resourceVersion) is followed by a fresh list after a short backoff, so missed events cannot
leave stale replicas behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from relayrl.core.sockets import keepalive_socket_options
from relayrl.gateway.config import KubernetesDiscoveryConfig
from relayrl.gateway.replicas import ReplicaPool
from relayrl.inference.client import EngineClient, VllmEngineClient

logger = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
WATCH_GRACE_S = 10.0  # how long a read may outlast the watch's server-side timeout


def endpoint_urls(slices: Iterable[Any], port_name: str | None, scheme: str) -> dict[str, str]:
    """replica id -> URL for every ready endpoint of `slices` (V1EndpointSlice objects or
    their dict form). The id is the pod name when the endpoint names one, else its address."""
    urls: dict[str, str] = {}
    for eps in slices:
        ports = _get(eps, "ports") or []
        port = next((p for p in ports if port_name is None or _get(p, "name") == port_name), None)
        if port is None or _get(port, "port") is None:
            continue
        for endpoint in _get(eps, "endpoints") or []:
            conditions = _get(endpoint, "conditions")
            if conditions is not None and _get(conditions, "ready") is False:
                continue
            addresses = _get(endpoint, "addresses") or []
            if not addresses:
                continue
            address = addresses[0]
            host = f"[{address}]" if ":" in address else address
            target = _get(endpoint, "target_ref") or _get(endpoint, "targetRef")
            replica_id = (_get(target, "name") if target is not None else None) or address
            urls[replica_id] = f"{scheme}://{host}:{_get(port, 'port')}"
    return urls


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        camel = name.split("_")[0] + "".join(p.title() for p in name.split("_")[1:])
        return obj.get(name, obj.get(camel))
    return getattr(obj, name, None)


class EndpointSliceDiscovery:
    def __init__(
        self,
        pool: ReplicaPool,
        config: KubernetesDiscoveryConfig,
        *,
        make_client: Callable[[str], EngineClient] = VllmEngineClient,
        api: Any = None,
    ) -> None:
        """`api`: a kubernetes DiscoveryV1Api (built from `config` when None)."""
        self._pool = pool
        self._config = config
        self._make_client = make_client
        self._api = api
        self._slices: dict[str, Any] = {}  # slice name -> object
        self._known: dict[str, str] = {}  # replica id -> url, as registered by us
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def _build_api(self) -> Any:
        import urllib3
        from kubernetes import client, config

        if self._config.api_host:
            configuration = client.Configuration()
            configuration.host = self._config.api_host
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            configuration = client.Configuration.get_default_copy()
        # urllib3 replaces its default options (TCP_NODELAY) by the ones it is given
        configuration.socket_options = [
            *urllib3.connection.HTTPConnection.default_socket_options,
            *keepalive_socket_options(self._config.http.tcp_keepalive),
        ]
        return client.DiscoveryV1Api(client.ApiClient(configuration))

    def _timeout(self) -> tuple[float, float]:
        """(connect, read) of a list or watch. A watch is quiet for as long as nothing changes,
        so the read outlasts the watch's own server-side timeout; a silent API server is
        noticed sooner by TCP keepalive."""
        return (self._config.http.connect_timeout_s, self._config.watch_timeout_s + WATCH_GRACE_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="endpointslice-discovery")

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            try:
                if self._api is None:
                    self._api = await asyncio.to_thread(self._build_api)
                version = await self._list()
                failures = 0
                await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S) - 1)]
                failures += 1
                logger.warning(
                    "EndpointSlice discovery of %s/%s failed (%s); relisting in %.1f s",
                    self._config.namespace,
                    self._config.service,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _list(self) -> str:
        answer = await asyncio.to_thread(
            self._api.list_namespaced_endpoint_slice,
            self._config.namespace,
            label_selector=f"{SERVICE_LABEL}={self._config.service}",
            _request_timeout=self._timeout(),
        )
        self._slices = {item.metadata.name: item for item in answer.items}
        await self._reconcile()
        return answer.metadata.resource_version

    async def _watch(self, resource_version: str) -> None:
        from kubernetes import watch

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        watcher = watch.Watch()

        def pump() -> None:
            try:
                for event in watcher.stream(
                    self._api.list_namespaced_endpoint_slice,
                    self._config.namespace,
                    label_selector=f"{SERVICE_LABEL}={self._config.service}",
                    resource_version=resource_version,
                    timeout_seconds=self._config.watch_timeout_s,
                    _request_timeout=self._timeout(),
                ):
                    loop.call_soon_threadsafe(events.put_nowait, event)
            finally:
                loop.call_soon_threadsafe(events.put_nowait, None)

        pumping = asyncio.create_task(asyncio.to_thread(pump))
        try:
            while (event := await events.get()) is not None:
                item = event["object"]
                name = item.metadata.name
                if event["type"] == "DELETED":
                    self._slices.pop(name, None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    self._slices[name] = item
                await self._reconcile()
            await pumping  # re-raises what ended the watch
        finally:
            watcher.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(pumping), 1.0)

    async def _reconcile(self) -> None:
        wanted = endpoint_urls(self._slices.values(), self._config.port_name, self._config.scheme)
        for replica_id, url in list(self._known.items()):
            if wanted.get(replica_id) != url:
                logger.info("replica %s (%s) left the Service's endpoints", replica_id, url)
                del self._known[replica_id]
                await self._pool.remove(replica_id)
        for replica_id, url in wanted.items():
            if replica_id not in self._known:
                logger.info("replica %s (%s) joined the Service's endpoints", replica_id, url)
                self._known[replica_id] = url
                await self._pool.add(replica_id, self._make_client(url), source="endpointslice")

    @property
    def known(self) -> dict[str, str]:
        return dict(self._known)

    async def close(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
