"""`custom`: a user's manager or scoring function, named by dotted path in the operator's
config (never by a remote caller: ScoreOptions only picks among configured managers).

The object at `path` is either
- a `RewardManager` subclass, constructed as `cls(name, **options)`; or
- a scoring function `fn(item: RewardItem) -> Verdict | float` (sync or async; a float is an
  OK score), called per item. Sync functions run in a thread so a slow one does not stall the
  service's event loop.

tests/unit/reward/test_reward_plugin_contract.py pins both signatures.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from relayrl.core.dotted import DOTTED_PATH, import_object
from relayrl.reward.items import InfraError, RewardItem, Verdict
from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, RewardManager


class CustomConfig(ManagerConfigBase):
    """A user manager class or scoring function, imported by dotted path when the service
    starts."""

    type: Literal["custom"] = Field(description="Manager type.")
    path: str = Field(
        pattern=DOTTED_PATH,
        description="`package.module:ClassOrFunction`; the package must be installed in the "
        "service's image.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for a manager class's constructor (not allowed for a "
        "function).",
    )
    max_concurrent: int = Field(
        8, ge=1, le=4096, description="Items of one call scored at once by a function."
    )

    def build(self, name: str, context: ManagerContext) -> RewardManager:
        target = import_object(self.path, "custom manager")
        if inspect.isclass(target):
            if not issubclass(target, RewardManager):
                raise ValueError(f"{self.path} is a class but not a relayrl RewardManager subclass")
            return target(name, **self.options)
        if callable(target):
            if self.options:
                raise ValueError(
                    f"{self.path} is a function; `options` only apply to manager classes"
                )
            return FunctionManager(name, target, max_concurrent=self.max_concurrent)
        raise ValueError(f"{self.path} is neither a RewardManager subclass nor a function")


class FunctionManager(RewardManager):
    """Adapts a scoring function to the manager contract."""

    type_name = "custom"

    def __init__(
        self, name: str, function: Callable[[RewardItem], Any], *, max_concurrent: int
    ) -> None:
        super().__init__(name, max_concurrent=max_concurrent)
        self._function = function
        self._is_async = inspect.iscoroutinefunction(function)

    async def score(self, item: RewardItem) -> Verdict:
        if self._is_async:
            value = await self._function(item)
        else:
            value = await asyncio.to_thread(self._function, item)
        if isinstance(value, Verdict):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return Verdict(score=float(value))
        raise InfraError(
            f"{self.name}: the scoring function returned {type(value).__name__}; return a "
            "Verdict or a float"
        )
