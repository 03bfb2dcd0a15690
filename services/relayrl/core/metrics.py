"""Prometheus metrics: naming rules and the `/metrics` HTTP endpoint.

Each service owns one `CollectorRegistry`, created in its main and passed to whatever records
metrics; nothing registers into prometheus_client's global registry and nothing is created at
import time, so two services (or two tests) in one process never collide.

Names follow `relayrl_<service>_<quantity>_<unit>` in base units (seconds, bytes) with
`_total` for counters, e.g. `relayrl_reward_grpc_request_duration_seconds`.
"""

from __future__ import annotations

import logging
import re
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from relayrl.core.config import MetricsConfig

logger = logging.getLogger(__name__)

_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# Prometheus convention is base units; a dashboard mixing ms and s is a classic bug.
_NON_BASE_UNITS = {
    "ms": "seconds",
    "millis": "seconds",
    "milliseconds": "seconds",
    "us": "seconds",
    "microseconds": "seconds",
    "ns": "seconds",
    "minutes": "seconds",
    "hours": "seconds",
    "kb": "bytes",
    "kib": "bytes",
    "mb": "bytes",
    "mib": "bytes",
    "gb": "bytes",
    "gib": "bytes",
    "percent": "ratio",
}


def check_service_name(service: str) -> str:
    """Return `service` if usable inside a metric name, else raise ValueError saying why."""
    if not _SNAKE.match(service):
        suggestion = re.sub(r"[^a-z0-9]+", "_", service.lower()).strip("_")
        raise ValueError(
            f"service name {service!r} must be lower snake_case (letters, digits, single "
            f"underscores) to appear in metric names; try {suggestion!r}"
        )
    return service


def metric_name(service: str, quantity: str, unit: str) -> str:
    """`relayrl_<service>_<quantity>_<unit>`, validated so that every service's metrics share
    one prefix and base units; e.g. metric_name("reward", "batch_size", "items")."""
    check_service_name(service)
    for part, value in (("quantity", quantity), ("unit", unit)):
        if not _SNAKE.match(value):
            raise ValueError(f"metric {part} {value!r} must be lower snake_case")
    if unit in _NON_BASE_UNITS:
        raise ValueError(
            f"metric unit {unit!r} is not a base unit; record {_NON_BASE_UNITS[unit]} instead"
        )
    if quantity.endswith("_" + unit) or quantity == unit:
        raise ValueError(f"metric quantity {quantity!r} already ends with the unit {unit!r}")
    return f"relayrl_{service}_{quantity}_{unit}"


class MetricsServer:
    """Serves one registry on `http://host:port/metrics` from a daemon thread.

    The thread is prometheus_client's own WSGI server; this class adds a bound port (port 0
    picks a free one) and a stop that really releases the socket, which tests and graceful
    shutdown need."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self._registry = registry
        self._host = host
        self._port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: MetricsConfig, registry: CollectorRegistry) -> MetricsServer:
        return cls(registry, host=config.host, port=config.port)

    @property
    def port(self) -> int:
        """The bound port; only valid while started."""
        if self._server is None:
            raise RuntimeError("MetricsServer is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> int:
        """Bind and serve; return the bound port."""
        if self._server is not None:
            raise RuntimeError("MetricsServer is already started")
        try:
            self._server, self._thread = start_http_server(
                self._port, addr=self._host, registry=self._registry
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot serve metrics on {self._host}:{self._port} ({exc.strerror}); "
                "choose another metrics.port (0 picks a free one)",
            ) from exc
        logger.info("serving metrics on %s", self.url)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket (blocks up to the server's 0.5 s poll interval)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = None
        self._thread = None
