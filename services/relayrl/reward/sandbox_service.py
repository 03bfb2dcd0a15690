"""`relayrl-sandbox`: the code sandbox as a process of its own, for a reward-service that may not
isolate code itself (docs/security.md#the-code-sandbox-in-a-pod).

A reward pod in a shared cluster runs as a non-root uid with every capability dropped. There
the `sandbox` manager cannot give candidate code a private network namespace or a uid of its
own, and it fails closed. This service is what the chart runs next to it, in a container of the
same pod with only the capabilities the sandbox needs (SYS_ADMIN for the network namespace,
SETUID/SETGID for the per-slot uids, and the few to hand work dirs over and kill its children)
and none of the pod's secrets. The reward container reaches it through a unix socket on a
volume the two share, with a `sandbox_remote` manager (relayrl.reward.managers.sandbox_remote).

Who may call: the socket is owned by the one allowed uid with mode 0600, and every connection's
peer uid (SO_PEERCRED) must be in `allow_uids`; anything else gets a refusal line and nothing
runs. Candidate code runs as `sandbox.sandbox_uid_base + slot`, never in `allow_uids`, so it
cannot submit code of its own even where the socket is visible to it.

Protocol: one request per connection. The client writes one JSON line
`{"item_id": str, "code": str, "tests": str}` and reads one JSON line back:
`{"status": "OK" | "POLICY_FAIL", "score": float, "components": {...}, "message": str}` for a
judged answer, or `{"status": "INVALID_INPUT" | "INFRA_ERROR" | "PERMISSION_DENIED",
"message": str}`. The client keeps the connection open until the answer: closing it, or only
its write side, before then cancels the run (the child is killed). The limits are this
service's own config: the caller cannot raise them. The line `{"ping": true}` is answered
`{"status": "OK", ...}` without running anything; the service's own uid may send that and
nothing else (the container's probe: `python -m relayrl.core.healthcheck sandbox SOCKET`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from relayrl.core.config import ConfigError, LoggingConfig, StrictModel
from relayrl.reward.items import InfraError, InvalidItem, Verdict
from relayrl.reward.managers.sandbox import CodeTest, SandboxConfig, SandboxManager, parse_tests

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_REPLY_BYTES = 1024 * 1024
PING = b'{"ping": true}'


class SandboxServiceConfig(StrictModel):
    """`relayrl-sandbox`'s config: where it listens, who may call, and the sandbox's limits."""

    socket: Path = Field(description="Path of the unix socket it listens on (created at start).")
    allow_uids: list[int] = Field(
        min_length=1,
        description="Uids that may submit code (the reward container's runAsUser); the socket "
        "is handed to the first. Candidate uids (sandbox.sandbox_uid_base + slot) may not be "
        "among them.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=lambda: SandboxConfig(type="sandbox"),
        description="The sandbox's limits and layers, as a `sandbox` manager's fields "
        "(type may be left out).",
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="before")
    @classmethod
    def _sandbox_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("sandbox"), dict):
            data = {**data, "sandbox": {"type": "sandbox", **data["sandbox"]}}
        return data

    @model_validator(mode="after")
    def _candidates_cannot_call(self) -> SandboxServiceConfig:
        base = self.sandbox.sandbox_uid_base
        if base is not None:
            candidates = range(base, base + self.sandbox.max_concurrent)
            clash = sorted(uid for uid in self.allow_uids if uid in candidates)
            if clash:
                raise ValueError(
                    f"allow_uids {clash} are sandbox slot uids ({candidates.start}.."
                    f"{candidates.stop - 1}): candidate code could submit code"
                )
        return self


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def encode(message: dict[str, object]) -> bytes:
    return json.dumps(message, ensure_ascii=False).encode("utf-8") + b"\n"


def reply_of(verdict: Verdict) -> dict[str, object]:
    return {
        "status": verdict.status.name,
        "score": verdict.score,
        "components": dict(verdict.components),
        "message": verdict.message,
    }


def parse_request(line: bytes) -> tuple[str, str, list[CodeTest]]:
    """(item id, code, tests) of a request line; InvalidItem saying what is wrong with it."""
    try:
        request = json.loads(line)
    except ValueError as exc:
        raise InvalidItem(f"the request is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidItem("the request must be a JSON object")
    fields = {key: request.get(key) for key in ("item_id", "code", "tests")}
    wrong = [key for key, value in fields.items() if not isinstance(value, str)]
    if wrong:
        raise InvalidItem(f"the request needs string fields: {', '.join(wrong)}")
    item_id, code, tests = (str(value) for value in fields.values())
    try:
        return item_id, code, parse_tests(tests)
    except ValueError as exc:
        raise InvalidItem(f"item {item_id!r}: {exc}") from None


class SandboxService:
    """Accepts connections, checks the caller, scores one item per connection."""

    def __init__(self, config: SandboxServiceConfig, manager: SandboxManager) -> None:
        self.config = config
        self.manager = manager
        self.served = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply = await self._answer(reader, writer)
            if reply is not None:
                writer.write(encode(reply))
                await writer.drain()
        except (ConnectionError, OSError) as exc:
            logger.info("a caller went away before its answer: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, object] | None:
        uid = peer_uid(writer.get_extra_info("socket"))
        may_submit = uid in self.config.allow_uids
        if not may_submit and uid != os.geteuid():
            logger.warning(
                "refused a caller with uid %d (allowed: %s)", uid, self.config.allow_uids
            )
            return {
                "status": "PERMISSION_DENIED",
                "message": f"uid {uid} may not submit code to this sandbox "
                f"(allow_uids: {self.config.allow_uids})",
            }
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            return {
                "status": "INVALID_INPUT",
                "message": f"the request is over {MAX_REQUEST_BYTES} bytes",
            }
        except asyncio.IncompleteReadError:
            return None  # hung up without a request
        if line.strip() == PING:
            return {"status": "OK", "message": "alive", "served": self.served}
        if not may_submit:  # the service's own uid: the container's probe
            return {
                "status": "PERMISSION_DENIED",
                "message": f"uid {uid} (this service's own) may only ping",
            }
        try:
            item_id, code, tests = parse_request(line)
        except InvalidItem as exc:
            return {"status": "INVALID_INPUT", "message": exc.message}
        scoring = asyncio.ensure_future(self.manager.judge(code, tests))
        hangup = asyncio.ensure_future(_end_of(reader))  # EOF: the caller gave up
        try:
            await asyncio.wait({scoring, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
        if not scoring.done():
            scoring.cancel()
            with contextlib.suppress(asyncio.CancelledError, InfraError):
                await scoring
            logger.info("item %s: the caller hung up; its sandbox was killed", item_id)
            return None
        self.served += 1
        try:
            return reply_of(scoring.result())
        except InfraError as exc:
            logger.warning("item %s: %s", item_id, exc.message)
            return {"status": "INFRA_ERROR", "message": exc.message}


async def _end_of(reader: asyncio.StreamReader) -> None:
    """Return at the caller's EOF or reset (whatever it sends after its request line is
    ignored)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 16):
            pass


def _clear_socket_path(path: Path) -> None:
    """Remove a stale socket at `path`; refuse anything else there."""
    if path.is_symlink() or (path.exists() and not path.is_socket()):
        raise ConfigError(f"socket {path}: exists and is not a socket; refusing to replace it")
    if not path.parent.is_dir():
        raise ConfigError(f"socket {path}: directory {path.parent} does not exist")
    path.unlink(missing_ok=True)


async def run(config: SandboxServiceConfig, ready_file: Path | None) -> None:
    manager = SandboxManager("sandbox", config.sandbox)
    try:
        layers = await manager.isolation_layers()
    except InfraError as exc:
        raise ConfigError(f"the sandbox cannot isolate code here: {exc.message}") from None
    service = SandboxService(config, manager)
    path = config.socket
    _clear_socket_path(path)
    server = await asyncio.start_unix_server(
        service.handle, path=str(path), limit=MAX_REQUEST_BYTES
    )
    try:
        os.chmod(path, 0o600)
        if os.geteuid() == 0:
            os.chown(path, config.allow_uids[0], -1)
        elif os.geteuid() != config.allow_uids[0]:
            raise ConfigError(
                f"socket {path}: running as uid {os.geteuid()}, cannot hand it to uid "
                f"{config.allow_uids[0]}"
            )
        logger.info(
            "sandbox serving on %s for uids %s; layers: %s", path, config.allow_uids, layers
        )
        if ready_file is not None:
            ready = {"pid": os.getpid(), "socket": str(path), "layers": list(layers)}
            partial = ready_file.with_name(ready_file.name + ".partial")
            partial.write_text(json.dumps(ready), encoding="utf-8")
            partial.replace(ready_file)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        server.close()
        await manager.close()
        path.unlink(missing_ok=True)
    logger.info("sandbox stopped after %d items", service.served)


def serve(config: SandboxServiceConfig, ready_file: Path | None = None) -> int:
    from relayrl.core.logs import setup_logging

    setup_logging(config.logging, "sandbox")
    try:
        asyncio.run(run(config, ready_file))
    except (ConfigError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    return 0
