"""The typed composition of the whole system (`StackConfig`): see relayrl.stack.config."""

from relayrl.stack.config import (
    SERVICES,
    Endpoint,
    Endpoints,
    EngineDiscovery,
    Identities,
    RolloutShape,
    StackConfig,
    StackError,
    Wiring,
    as_file,
    disagreements,
)

__all__ = [
    "SERVICES",
    "Endpoint",
    "Endpoints",
    "EngineDiscovery",
    "Identities",
    "RolloutShape",
    "StackConfig",
    "StackError",
    "Wiring",
    "as_file",
    "disagreements",
]
