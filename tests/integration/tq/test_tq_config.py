"""Building a TransferQueue from its config section."""

from __future__ import annotations

import pytest

from relayrl.core.config import ConfigError, load_config
from relayrl.tq import (
    InvalidInputError,
    TQAuthenticationError,
    TQConfig,
    TQUnavailableError,
    TransferQueue,
)
from relayrl.tq.server import RedisServer


def test_from_config_creates_the_partitions(redis_server: RedisServer) -> None:
    config = TQConfig(url=redis_server.url, namespace="run-1", partitions=["train", "eval"])
    tq = TransferQueue.from_config(config)
    assert tq.partitions() == ["eval", "train"]
    assert TransferQueue.from_config(config.model_copy(update={"namespace": "b"})).partitions() == [
        "eval",
        "train",
    ]
    tq.check_durability()  # the fixture's server runs AOF everysec, the default


def test_password_from_the_environment(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = RedisServer(tmp_path / "r", password="s3cret-pass")
    server.start()
    try:
        config = TQConfig(url=server.url, password_env="TEST_TQ_PASSWORD")
        with pytest.raises(InvalidInputError, match="TEST_TQ_PASSWORD"):
            TransferQueue.from_config(config)
        monkeypatch.setenv("TEST_TQ_PASSWORD", "wrong")
        with pytest.raises(TQAuthenticationError, match="refused the credentials"):
            TransferQueue.from_config(config)
        monkeypatch.setenv("TEST_TQ_PASSWORD", "s3cret-pass")
        assert TransferQueue.from_config(config).partitions() == ["train", "val"]
    finally:
        server.kill()


def test_unreachable_redis(tmp_path) -> None:
    url = RedisServer(tmp_path / "nobody").url
    with pytest.raises(TQUnavailableError, match="unavailable"):
        TransferQueue.from_config(TQConfig(url=url, connect_timeout_s=0.5))


def test_config_mistakes_name_the_field(tmp_path) -> None:
    path = tmp_path / "tq.yaml"
    path.write_text("partitions: [train, Bad Name]\n")
    with pytest.raises(ConfigError, match="partitions"):
        load_config(TQConfig, path, "RELAYRL_TQ")
    with pytest.raises(ConfigError, match="max_value_bytes"):
        load_config(TQConfig, None, "RELAYRL_TQ", {"RELAYRL_TQ__MAX_VALUE_BYTES": "12"})
