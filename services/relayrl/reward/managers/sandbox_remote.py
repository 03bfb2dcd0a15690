"""The `sandbox_remote` reward manager: the `sandbox` manager's scoring, done by a
`relayrl-sandbox` process over a unix socket (relayrl.reward.sandbox_service).

Items are the `sandbox` manager's (the code is the response's last ```python block, the tests
in `extra["tests"]` or `ground_truth`) and verdicts the same; the limits and isolation layers
are the sandbox service's. Use it where the reward-service cannot isolate code itself: a pod
running as non-root with every capability dropped (the chart's `reward.sandbox`). Everything
that keeps the sandbox from answering — not running, refusing this uid, failing to isolate —
is INFRA_ERROR, never a reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Literal

from pydantic import Field

from relayrl.reward.items import InfraError, InvalidItem, RewardItem, Status, Verdict
from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, RewardManager
from relayrl.reward.managers.sandbox import extract_code, item_tests
from relayrl.reward.sandbox_service import MAX_REPLY_BYTES, encode


class RemoteSandboxConfig(ManagerConfigBase):
    """A `sandbox_remote` manager: sends each item to a sandbox service's unix socket."""

    type: Literal["sandbox_remote"] = Field(description="Manager type.")
    socket: str = Field(
        min_length=1,
        max_length=107,  # sun_path
        description="Path of the sandbox service's unix socket (its config's `socket`).",
    )
    max_concurrent: int = Field(
        2,
        ge=1,
        le=1024,
        description="Items sent at once (more wait here; the service runs at most its own "
        "max_concurrent and queues the rest).",
    )
    timeout_s: float | None = Field(
        120.0,
        gt=0.0,
        le=86_400.0,
        description="Deadline of one item, queueing in the service included; past it the "
        "item is TIMEOUT and the connection is closed, which kills its sandbox.",
    )

    def build(self, name: str, context: ManagerContext) -> RemoteSandboxManager:
        return RemoteSandboxManager(name, self)


class RemoteSandboxManager(RewardManager):
    type_name = "sandbox_remote"

    def __init__(self, name: str, config: RemoteSandboxConfig) -> None:
        super().__init__(name, max_concurrent=config.max_concurrent)
        self.config = config

    def validate(self, item: RewardItem) -> None:
        item_tests(item)[0]

    async def score(self, item: RewardItem) -> Verdict:
        request = {
            "item_id": item.item_id,
            "code": extract_code(item.response),
            "tests": item_tests(item)[0],
        }
        reply = await self._ask(request)
        status = reply.get("status")
        message = str(reply.get("message", ""))
        if status in (Status.OK.name, Status.POLICY_FAIL.name):
            try:
                components = {str(k): float(v) for k, v in dict(reply["components"]).items()}
                return Verdict(float(reply["score"]), Status[status], components, message)
            except (KeyError, TypeError, ValueError) as exc:
                raise InfraError(f"the sandbox service's answer is malformed: {exc}") from None
        if status == "INVALID_INPUT":
            raise InvalidItem(message)
        raise InfraError(f"the sandbox service at {self.config.socket}: {status}: {message}")

    async def _ask(self, request: dict[str, str]) -> dict[str, object]:
        where = self.config.socket
        try:
            reader, writer = await asyncio.open_unix_connection(where, limit=MAX_REPLY_BYTES)
        except OSError as exc:
            raise InfraError(
                f"the sandbox service at {where} is not reachable ({exc.strerror or exc}); "
                "is relayrl-sandbox running (chart: reward.sandbox.enabled)?"
            ) from None
        try:
            with contextlib.suppress(ConnectionError):
                # a service that refuses this caller answers and closes without reading: the
                # write may fail, and its answer says why
                writer.write(encode(request))
                await writer.drain()
            line = await reader.readuntil(b"\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise InfraError(f"the sandbox service at {where} hung up: {exc}") from None
        finally:
            writer.close()  # on cancellation too: the service kills the item's sandbox
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise InfraError(f"the sandbox service at {where} answered {line[:200]!r}")
        return reply
