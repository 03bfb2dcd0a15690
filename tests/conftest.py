"""Fixtures shared by the whole suite: private redis-servers and TransferQueues on them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-learning",
        action="store_true",
        help="run the `learning` tests (the full default `relayrl up`, ~15 min each)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-learning"):
        return
    skip = pytest.mark.skip(reason="a full learning run: `make test-learning` runs it")
    for item in items:
        if "learning" in item.keywords:
            item.add_marker(skip)


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
