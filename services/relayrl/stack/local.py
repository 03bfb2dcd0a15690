"""The system on one machine: every service on ports chosen once per run (a restarted service
comes back where its peers already look for it), each part at its host's address.

By default every part's host is this machine's loopback. A run whose parts each get a host of
their own (`relayrl up`'s `hosts.isolate`, relayrl.up.hosts) gives each part's address here,
and every bind address, URL and target of the composition follows from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from relayrl.core.ports import free_port
from relayrl.stack.config import SERVICES, Endpoint, Endpoints

LOOPBACK = "127.0.0.1"
ENGINE = "engine-0"
"""The one engine replica's name (its replica id, its child's name)."""
AGENTS = "agents"
"""Where the gateway's agent programs run (they reach its agent endpoint)."""
PARTS = ("redis", *SERVICES, ENGINE, AGENTS)
"""Everything that may have a host of its own."""


@dataclass
class LocalPorts:
    redis: int
    engine: int
    grpc: dict[str, int]
    metrics: dict[str, int]
    agent_http: int
    addresses: Mapping[str, str] = field(default_factory=dict)
    """part (PARTS) -> the address of its host; a part not named is on LOOPBACK."""

    @classmethod
    def choose(cls) -> LocalPorts:
        """Distinct free loopback ports for Redis, one engine, every service and the agent
        endpoint, outside the kernel's ephemeral range: some are bound minutes later (after
        the warm start and the engine's boot; relayrl.core.ports). A host of a part's own is
        a fresh network namespace, where every port is free."""
        taken: set[int] = set()

        def pick() -> int:
            return free_port(avoid=taken)

        return cls(
            redis=pick(),
            engine=pick(),
            grpc={s: pick() for s in SERVICES},
            metrics={s: pick() for s in SERVICES},
            agent_http=pick(),
        )

    @classmethod
    def placeholder(cls) -> LocalPorts:
        """Fixed distinct ports, for checking a composition before any port is chosen."""
        ports = iter(range(20000, 20100))
        return cls(
            redis=next(ports),
            engine=next(ports),
            grpc={s: next(ports) for s in SERVICES},
            metrics={s: next(ports) for s in SERVICES},
            agent_http=next(ports),
        )

    def at(self, addresses: Mapping[str, str]) -> LocalPorts:
        """The same ports with each part of `addresses` on that host."""
        unknown = sorted(set(addresses) - set(PARTS))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a part of the local stack {PARTS}")
        return replace(self, addresses=dict(addresses))

    def address(self, part: str) -> str:
        """The address `part` binds and its peers dial."""
        return self.addresses.get(part, LOOPBACK)

    def endpoints(self) -> Endpoints:
        return Endpoints(**{s: self._endpoint(s) for s in SERVICES})

    def _endpoint(self, service: str) -> Endpoint:
        host, port = self.address(service), self.grpc[service]
        return Endpoint(
            bind_host=host, grpc_port=port, metrics_port=self.metrics[service],
            target=f"{host}:{port}",
        )  # fmt: skip

    def target(self, service: str) -> str:
        """host:port of `service`'s gRPC server."""
        return self._endpoint(service).target

    def metrics_url(self, service: str) -> str:
        return f"http://{self.address(service)}:{self.metrics[service]}/metrics"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.address('redis')}:{self.redis}/0"

    @property
    def engine_url(self) -> str:
        return f"http://{self.address(ENGINE)}:{self.engine}"
