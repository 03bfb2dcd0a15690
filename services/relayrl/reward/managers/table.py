"""The closed table of manager types, and building the configured managers in dependency
order (a wrapper after the manager it wraps).

Adding a built-in type means adding its config class here; a user's own manager needs no
change here: it is configured as `type: custom` with a dotted `path`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, RewardManager
from relayrl.reward.managers.custom import CustomConfig
from relayrl.reward.managers.env import EnvConfig
from relayrl.reward.managers.gdpo import GdpoConfig
from relayrl.reward.managers.judge import DisRMConfig, GenRMConfig, RemoteConfig
from relayrl.reward.managers.naive import NaiveConfig
from relayrl.reward.managers.reasoning_gym import ReasoningGymConfig
from relayrl.reward.managers.sandbox import SandboxConfig
from relayrl.reward.managers.sandbox_remote import RemoteSandboxConfig
from relayrl.reward.managers.wrappers import DapoConfig, RateLimitedConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ManagerConfig = Annotated[
    NaiveConfig
    | RateLimitedConfig
    | RemoteConfig
    | GenRMConfig
    | DisRMConfig
    | DapoConfig
    | GdpoConfig
    | SandboxConfig
    | RemoteSandboxConfig
    | ReasoningGymConfig
    | EnvConfig
    | CustomConfig,
    Field(discriminator="type"),
]

MANAGER_TYPES: tuple[str, ...] = (
    "naive",
    "rate_limited",
    "remote",
    "genrm",
    "disrm",
    "dapo",
    "gdpo",
    "sandbox",
    "sandbox_remote",
    "reasoning_gym",
    "env",
    "custom",
)


def build_order(configs: Mapping[str, ManagerConfigBase]) -> list[str]:
    """Manager names with every wrapped manager before its wrapper; ValueError naming a
    missing reference or a cycle."""
    order: list[str] = []
    state: dict[str, str] = {}  # name -> "visiting" | "done"

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise ValueError(f"managers wrap each other in a cycle: {cycle}")
        state[name] = "visiting"
        for inner in configs[name].inner_managers():
            if inner not in configs:
                raise ValueError(
                    f"managers.{name} wraps {inner!r}, which is not configured "
                    f"(configured: {', '.join(sorted(configs))})"
                )
            visit(inner, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in configs:
        visit(name, [])
    return order


def build_managers(
    configs: Mapping[str, ManagerConfigBase], registry: CollectorRegistry | None = None
) -> dict[str, RewardManager]:
    """Build every configured manager (inside the running event loop)."""
    built: dict[str, RewardManager] = {}
    context = ManagerContext(managers=built, registry=registry)
    for name in build_order(configs):
        built[name] = configs[name].build(name, context)  # type: ignore[attr-defined]
    return built
