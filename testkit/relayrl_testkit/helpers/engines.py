"""Real vLLM engines (`python -m relayrl.engine`) for tests, on the tiny model.

Starting one costs about 35 s of this machine's two cores, so a test session shares one
(`SharedEngine`): tests lease it in turn, and after each test it is put back as it was found
-- resumed, its own weights reloaded if a test loaded others (checked by digest), its
weight-version label and prefix cache reset, idle. A test that killed it fails, and the next
test gets a fresh one. Tests that kill an engine or need other engine settings start a private
one (`start_engine`). What a restore cannot undo: the worker extension's record of which
transfer it holds (`relayrl_ping`) names the reloaded file, not the initial weights."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.inference.client import VllmEngineClient
from relayrl.inference.config import EngineHttpConfig

# What the test engines share unless a test asks for other settings: long enough for every
# prompt + response the tests send (the longest, 400 tokens after a short prompt); the tests
# load weight files from their temporary folders.
TEST_ENGINE_SETTINGS: dict[str, Any] = {
    "max_model_len": 1024,
    "load_dirs": [Path(tempfile.gettempdir())],
}
SESSION_VLLM_CACHE_ENV = "RELAYRL_TEST_VLLM_CACHE"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def vllm_cache(workdir: Path) -> Path:
    """vLLM's cache for a test engine in `workdir`: the session's when tests/conftest.py names
    one (SESSION_VLLM_CACHE_ENV), else the engine's own. vLLM inspects a model class in a
    subprocess unless its cache holds the answer, about 9 s of each boot here; the cache is
    keyed by the class's source and written atomically, so engines can share it."""
    shared = os.environ.get(SESSION_VLLM_CACHE_ENV)
    return Path(shared) if shared else workdir / "cache"


def spawn_engine(
    model_dir: Path, workdir: Path, *, env: dict[str, str] | None = None, **settings: Any
) -> EngineProcess:
    """An engine serving `model_dir` on a free loopback port, started but not yet waited for
    (`wait_ready`); its log and config in `workdir`, its vLLM cache where `vllm_cache` says.
    `env`: variables added to its environment; `settings`: EngineConfig fields over
    TEST_ENGINE_SETTINGS."""
    settings = {"cache_dir": vllm_cache(workdir), **TEST_ENGINE_SETTINGS, **settings}
    config = EngineConfig(model=model_dir, **settings)
    return EngineProcess(config, workdir, env=env).spawn()


def start_engine(
    model_dir: Path, workdir: Path, *, env: dict[str, str] | None = None, **settings: Any
) -> EngineProcess:
    """A private engine as `spawn_engine` starts it, ready."""
    return spawn_engine(model_dir, workdir, env=env, **settings).wait_ready()


@dataclass(frozen=True)
class EngineState:
    """What a test can change in an engine and a later test would see."""

    weight_version: str
    digest: str
    paused: bool


async def _read_state(client: VllmEngineClient) -> EngineState:
    (info,) = await client.worker_rpc("relayrl_weight_info", {})
    return EngineState(await client.weight_version(), info["digest"], await client.is_paused())


def engine_call(engine: EngineProcess, scenario: Any) -> Any:
    """`await scenario(client)` with a fresh client of `engine`, from synchronous code."""

    async def main() -> Any:
        client = VllmEngineClient(
            engine.url, http=EngineHttpConfig(control_timeout_s=120), rpc_timeout_s=120
        )
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(main())


def engine_digest(engine: EngineProcess) -> str:
    """The worker extension's checksum over the engine's parameters."""

    async def scenario(client: VllmEngineClient) -> str:
        (info,) = await client.worker_rpc("relayrl_weight_info", {})
        return info["digest"]

    return engine_call(engine, scenario)


def load_file_into(engine: EngineProcess, path: Path) -> None:
    """Loads a safetensors file into the engine by the worker extension's file path."""

    async def scenario(client: VllmEngineClient) -> None:
        await client.worker_rpc("relayrl_load_tensors", {"path": str(path)})

    engine_call(engine, scenario)


def _busy(engine: EngineProcess) -> float:
    """Requests running or waiting in the engine, from its /metrics."""
    text = _NO_PROXY.open(engine.url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(_BUSY_GAUGES):
            total += float(line.rsplit(" ", 1)[1])
    return total


class SharedEngine:
    """One engine for a whole test session, started on the first lease."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self._model_dir = model_dir
        self._workdir = workdir
        self._engine: EngineProcess | None = None
        self._initial: EngineState | None = None
        self.num_starts = 0

    def boot(self) -> None:
        """Starts the engine without waiting for it, so that it boots while other tests run;
        the first lease waits for it. Nothing happens when one is already started."""
        if self._engine is None:
            self.num_starts += 1
            workdir = self._workdir / f"engine-{self.num_starts}"
            self._engine = spawn_engine(self._model_dir, workdir)

    def lease(self) -> EngineProcess:
        self.boot()
        assert self._engine is not None
        if self._initial is None:  # its first lease
            try:
                self._engine.wait_ready()
            except BaseException:
                self.stop()
                raise
            self._initial = engine_call(self._engine, _read_state)
        return self._engine

    def restore(self, idle_timeout_s: float = 120.0) -> list[str]:
        """Puts the engine back as it was first found; returns what the lessee left that
        cannot be put back (the engine is then replaced for the next lessee)."""
        engine, initial = self._engine, self._initial
        if engine is None or initial is None:
            return []
        if not (engine.alive() and engine_call(engine, lambda client: client.health())):
            self.stop()  # the next lease starts a fresh one
            return ["the shared engine was killed or stopped answering: use a private engine"]

        weights = self._model_dir / "model.safetensors"

        async def put_back(client: VllmEngineClient) -> EngineState:
            if await client.is_paused():
                await client.resume()
            (info,) = await client.worker_rpc("relayrl_weight_info", {})
            if info["digest"] != initial.digest:  # a test loaded other weights
                await client.worker_rpc("relayrl_load_tensors", {"path": str(weights)})
            if await client.weight_version() != initial.weight_version:
                await client.set_weight_version(initial.weight_version)
            return await _read_state(client)

        now = engine_call(engine, put_back)
        problems = []
        if now.digest != initial.digest:
            problems.append(
                f"reloading {weights} did not give the shared engine its initial weights back"
            )
        deadline = time.monotonic() + idle_timeout_s
        while _busy(engine) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)  # requests of a gateway a test killed run to their end
        if problems or _busy(engine) > 0:
            self.stop()  # the next lease starts a fresh one
        else:
            engine_call(engine, lambda client: client.reset_prefix_cache())
        return problems

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
            self._initial = None
