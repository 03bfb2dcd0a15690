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


@pytest.fixture
def tls_pki(tmp_path):
    from relayrl_testkit.helpers.pki import make_ca, make_cert

    directory = tmp_path / "pki"
    directory.mkdir()
    make_ca(directory, "ca")
    make_ca(directory, "other-ca")
    make_cert(directory, "ca", "redis", san="DNS:localhost,IP:127.0.0.1")
    make_cert(directory, "ca", "client")
    return directory


def test_a_redis_serving_mutual_tls_is_reached_with_the_ca_and_client_certificate(
    tmp_path, tls_pki
) -> None:
    import asyncio

    from relayrl.core.config import TlsClientConfig
    from relayrl.reward.quotas import Demand, RedisQuotas
    from relayrl.tq.server import RedisTls

    tls = RedisTls(
        tls_pki / "redis.crt", tls_pki / "redis.key", tls_pki / "ca.crt", require_client_cert=True
    )
    server = RedisServer(tmp_path / "r", tls=tls)
    server.start()
    try:
        assert server.url.startswith("rediss://")
        client = TlsClientConfig(
            ca_file=tls_pki / "ca.crt",
            cert_file=tls_pki / "client.crt",
            key_file=tls_pki / "client.key",
        )
        config = TQConfig(url=server.url, tls=client, connect_timeout_s=2)
        tq = TransferQueue.from_config(config)
        assert tq.partitions() == ["train", "val"]
        tq.check_durability()
        # the reward-service's shared quotas use the same section
        quotas = RedisQuotas(config)
        wait, _ = asyncio.run(quotas.take("team-a", [Demand("requests_per_minute", 2.0, 1.0)]))
        assert wait == 0.0

        no_certificate = client.model_copy(update={"cert_file": None, "key_file": None})
        for other in (no_certificate, TlsClientConfig(ca_file=tls_pki / "other-ca.crt")):
            with pytest.raises(TQUnavailableError, match="unavailable"):
                TransferQueue.from_config(config.model_copy(update={"tls": other}))
        with pytest.raises(TQUnavailableError):  # plaintext to a TLS port
            TransferQueue.from_config(
                TQConfig(url=server.url.replace("rediss://", "redis://"), connect_timeout_s=2)
            )
    finally:
        server.kill()


def test_tls_settings_that_cannot_work_are_refused() -> None:
    from pydantic import ValidationError

    from relayrl.core.config import TlsClientConfig

    ca = TlsClientConfig(ca_file="/ca.crt")
    with pytest.raises(ValidationError, match="rediss://"):
        TQConfig(url="redis://h:6379/0", tls=ca)
    with pytest.raises(ValidationError, match="server_name is not supported"):
        TQConfig(url="rediss://h:6379/0", tls=ca.model_copy(update={"server_name": "x"}))
