"""The system on one machine: every service on loopback, on ports chosen once per run (a
restarted service comes back where its peers already look for it)."""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.core.ports import free_port
from relayrl.stack.config import SERVICES, Endpoint, Endpoints


@dataclass
class LocalPorts:
    redis: int
    engine: int
    grpc: dict[str, int]
    metrics: dict[str, int]
    agent_http: int

    @classmethod
    def choose(cls) -> LocalPorts:
        """Distinct free loopback ports for Redis, one engine, every service and the agent
        endpoint, outside the kernel's ephemeral range: some are bound minutes later (after
        the warm start and the engine's boot; relayrl.core.ports)."""
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

    def endpoints(self) -> Endpoints:
        return Endpoints(**{s: Endpoint.loopback(self.grpc[s], self.metrics[s]) for s in SERVICES})

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis}/0"

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine}"
