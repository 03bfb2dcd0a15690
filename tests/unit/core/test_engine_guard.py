"""The engine guard (relayrl.engine.guard) as an ASGI middleware in front of a stand-in app:
which caller reaches which route. The real engine behind it is exercised by `relayrl up` runs
(tests/integration/up), whose engines are guarded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl.core.config import ConfigError
from relayrl.core.interceptors import token_digest
from relayrl.engine.guard import CALLERS_ENV, ROUTES, EngineGuard, allowed_roles

TOKENS = {
    name: f"{name}-token-{'x' * 20}" for name in ("weightsync", "gateway", "operator", "trainer")
}


def call(guard: EngineGuard, path: str, token: str | None, body: bytes = b"") -> tuple[int, Any]:
    sent: list[dict[str, Any]] = []
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
    if path == "/collective_rpc" and not body:
        body = b'{"method": "relayrl_ping", "args": ["{}"]}'
    chunks = [body[:5], body[5:]]

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


async def app(scope: Any, receive: Any, send: Any) -> None:
    """Reached: answers with the request body it reads (as a JSON string)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send(
        {"type": "http.response.body", "body": json.dumps({"reached": body.decode()}).encode()}
    )


@pytest.fixture
def guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineGuard:
    callers = tmp_path / "tokens.yaml"
    callers.write_text(yaml.safe_dump({p: token_digest(t) for p, t in TOKENS.items()}))
    monkeypatch.setenv(CALLERS_ENV, str(callers))
    return EngineGuard(app)


def test_each_route_serves_only_its_roles(guard: EngineGuard) -> None:
    for route, roles in ROUTES:
        path = route + "x" if route.endswith("/") else route
        for principal, token in TOKENS.items():
            status, body = call(guard, path, token)
            assert status == (200 if principal in roles else 403), (path, principal)
        status, body = call(guard, path, None)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert call(guard, path, "unknown-token-xxxxxxxxxxxx")[0] == 401


def test_probes_are_open_and_unknown_routes_closed_to_everyone(guard: EngineGuard) -> None:
    assert call(guard, "/health", None) == (200, {"reached": ""})
    assert call(guard, "/metrics", None)[0] == 200
    for path in ("/sleep", "/collective_rpc/", "//collective_rpc", "/tokenize", "/inference"):
        assert allowed_roles(path) == frozenset()
        status, body = call(guard, path, TOKENS["weightsync"])
        assert status == 403 and "no caller" in body["error"]["message"], path
    status, body = call(guard, "/collective_rpc", TOKENS["gateway"])
    assert (
        body["error"]["message"] == "/collective_rpc is for weightsync; 'gateway' may not call it"
    )


def test_a_bad_callers_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callers = tmp_path / "tokens.yaml"
    callers.write_text("gateway: short\n")
    monkeypatch.setenv(CALLERS_ENV, str(callers))
    with pytest.raises(ConfigError, match="token of 'gateway' must be at least 16"):
        EngineGuard(app)


def test_collective_rpc_runs_only_relayrls_worker_methods(guard: EngineGuard) -> None:
    weightsync = TOKENS["weightsync"]
    ping = b'{"method": "relayrl_ping", "args": ["{}"]}'
    assert call(guard, "/collective_rpc", weightsync, ping) == (200, {"reached": ping.decode()})
    status, body = call(guard, "/collective_rpc", weightsync, b'{"method": "shutdown"}')
    assert (
        status == 403
        and "only relayrl's worker methods, not 'shutdown'" in body["error"]["message"]
    )
    for bad in (b"not json", b'{"method": 5}', b"[]"):
        assert call(guard, "/collective_rpc", weightsync, bad)[0] == 400, bad
