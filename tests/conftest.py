"""Fixtures shared by the whole suite: private redis-servers and TransferQueues on them, the
tiny model, and the session's vLLM engine (one for every module that only generates from it)
beside private engines for tests that kill one, change its weights or need other settings."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer

if TYPE_CHECKING:
    from relayrl.engine.process import EngineProcess
    from relayrl_testkit.helpers.engines import SharedEngine


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-learning",
        action="store_true",
        help="run the `learning` tests (the full default `relayrl up`, ~15 min each)",
    )
    parser.addoption(
        "--write-unit-costs",
        metavar="PATH",
        type=Path,
        help="with two or more workers: write the seconds each unit of work took, for the next "
        "runs to send the longest first (relayrl_testkit.helpers.workers)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--run-learning"):
        skip = pytest.mark.skip(reason="a full learning run: `make test-learning` runs it")
        for item in items:
            if "learning" in item.keywords:
                item.add_marker(skip)
    units_file = getattr(config, "workerinput", {}).get(UNITS_FILE)
    if units_file:  # a worker of `make test` (relayrl_testkit.helpers.workers)
        from relayrl_testkit.helpers.workers import order_by_unit, recorded_costs, write_units

        write_units(order_by_unit(items, recorded_costs()), Path(units_file))


# -- sharing the suite between workers (relayrl_testkit.helpers.workers) ----------------------

UNITS_FILE = "relayrl_units_file"
"""The key of the units file's path in each worker's `workerinput`."""


def _units_file(config: pytest.Config) -> Path:
    """Where the workers write each test's unit for the controller (made on first use)."""
    if not hasattr(config, "_relayrl_units_file"):
        config._relayrl_units_file = Path(tempfile.mkdtemp(prefix="relayrl-units-")) / "units"
    return config._relayrl_units_file


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "_relayrl_units_file") and not hasattr(config, "workerinput"):
        shutil.rmtree(config._relayrl_units_file.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadscope":
        return None
    from relayrl_testkit.helpers.workers import UnitScheduling

    return UnitScheduling(config, _units_file(config), log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if node.config.getoption("dist") == "loadscope":
        node.workerinput[UNITS_FILE] = str(_units_file(node.config))


_phase_durations: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _phase_durations.append((report.nodeid, report.duration))


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    path = config.getoption("--write-unit-costs")
    if path is None or hasattr(config, "workerinput"):
        return
    if not _units_file(config).exists():
        raise pytest.UsageError("--write-unit-costs needs the workers of `make test` (-n 2)")
    import json

    from relayrl_testkit.helpers.workers import unit_costs

    units = json.loads(_units_file(config).read_text())
    path.write_text(json.dumps(unit_costs(_phase_durations, units), indent=1) + "\n")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model and tokenizer (`relayrl model init` defaults), built once per run
    and shared read-only by every test that starts an engine or renders prompts."""
    from relayrl.models.tiny import TinyModelConfig, init_model

    directory = tmp_path_factory.mktemp("model") / "tiny"
    init_model(directory, TinyModelConfig())
    return directory


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server (AOF everysec) on a free loopback port, with its own data dir."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def tq(redis_server: RedisServer) -> Iterator[TransferQueue]:
    queue = TransferQueue(redis_server.client())
    queue.create_partition("train")
    queue.create_partition("val")
    try:
        yield queue
    finally:
        queue.close()


@pytest.fixture(scope="session")
def up_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `<runs>/cache` for the `relayrl up` runs of the session, its workers included (see
    relayrl_testkit.helpers.up.sharing_cache): the model and warm start are built once."""
    if "PYTEST_XDIST_WORKER" in os.environ:  # the folder above each worker's basetemp
        cache = tmp_path_factory.getbasetemp().parent / "up-cache"
        cache.mkdir(exist_ok=True)
        return cache
    return tmp_path_factory.mktemp("up-cache")


def _shared(model_dir: Path, workdir: Path) -> Iterator[SharedEngine]:
    from relayrl_testkit.helpers.engines import SharedEngine

    shared = SharedEngine(model_dir, workdir)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="session")
def shared_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedEngine]:
    yield from _shared(model_dir, tmp_path_factory.mktemp("shared-engine"))


@pytest.fixture(scope="session")
def shared_second_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedEngine]:
    yield from _shared(model_dir, tmp_path_factory.mktemp("shared-second-engine"))


@pytest.fixture(scope="session", autouse=True)
def _session_vllm_cache(up_cache: Path) -> Iterator[None]:
    """Every engine of the session, its workers' included, shares one vLLM cache: the one of
    the `relayrl up` runs (relayrl_testkit.helpers.engines.vllm_cache)."""
    from relayrl_testkit.helpers.engines import SESSION_VLLM_CACHE_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SESSION_VLLM_CACHE_ENV, str(up_cache / "vllm"))
        yield


@pytest.fixture(scope="session", autouse=True)
def _boot_the_shared_engine(request: pytest.FixtureRequest, _session_vllm_cache: None) -> None:
    """The session's engine boots from its first test on, while the tests before its first
    lessee run (that lessee waits for it). The second shared engine starts at its first lease:
    booted ahead too, it slowed the CPU-bound tests beside it by more than it saved. With
    workers, the engines' lessees are one unit (relayrl_testkit.helpers.workers), sent early
    to one worker: the other must not boot an engine it will never lease."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    if any("shared_engine" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("shared_engine").boot()


def _lease(
    request: pytest.FixtureRequest, shared: SharedEngine, name: str
) -> Iterator[EngineProcess]:
    yield shared.lease()
    problems = shared.restore()
    items = request.session.items
    later = items[items.index(request.node) + 1 :]
    if not any(name in item.fixturenames for item in later):
        shared.stop()  # nothing after this test uses it
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture
def engine(request: pytest.FixtureRequest, shared_engine: SharedEngine) -> Iterator[EngineProcess]:
    """The session's vLLM engine on the tiny model (max_model_len 1024), leased to one test at a
    time. Afterwards it is resumed, its own weights are reloaded if the test loaded others, its
    weight-version label and prefix cache are reset; a test that killed it fails here (the next
    one gets a fresh engine). Stopped after the last test that uses it."""
    yield from _lease(request, shared_engine, "shared_engine")


@pytest.fixture
def second_engine(
    request: pytest.FixtureRequest, shared_second_engine: SharedEngine
) -> Iterator[EngineProcess]:
    """Another shared engine like `engine`, for tests that need two replicas."""
    yield from _lease(request, shared_second_engine, "shared_second_engine")


@pytest.fixture
def private_engine(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    """Starts engines of the test's own: `private_engine("doomed", max_model_len=512)` (a
    folder name under tmp_path, then EngineConfig fields); each is stopped by PID after it."""
    from relayrl_testkit.helpers.engines import start_engine

    started: list[EngineProcess] = []

    def start(name: str = "engine", **settings: Any) -> EngineProcess:
        engine = start_engine(model_dir, tmp_path / name, **settings)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()
