"""Mutual TLS in front of the reward-service: the client certificate's CN is the tenant;
no certificate, or one from another CA, never gets a call through."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from relayrl.core.grpc_client import make_channel, tls_credentials
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2, reward_pb2_grpc
from relayrl_testkit.helpers.pki import make_ca, make_cert, mutual_tls_server
from relayrl_testkit.helpers.reward import RewardProcess


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    directory.mkdir()
    make_ca(directory, "ca")
    make_ca(directory, "rogue-ca")
    make_cert(directory, "ca", "server", san="DNS:localhost,IP:127.0.0.1")
    make_cert(directory, "ca", "team-a")
    make_cert(directory, "ca", "team-c")
    make_cert(directory, "rogue-ca", "rogue")
    return directory


def test_mutual_tls_names_the_tenant_by_certificate(pki: Path, tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "grpc": {"tls": mutual_tls_server(pki)},
        "auth": {"type": "mtls", "principals": ["team-a"]},
        "managers": {"rules": {"type": "naive"}},
        "default_manager": "rules",
        "tenants": {"team-a": {"requests_per_minute": 1}},
    }
    service = RewardProcess(tmp_path / "svc", config).start()
    request = reward_pb2.ScoreRequest(
        items=[
            common_pb2.RewardItem(
                item_id="a", data_source="gsm8k", response="#### 2", ground_truth="2"
            )
        ]
    )

    async def call(cert: str | None, ca: str = "ca") -> reward_pb2.ScoreResponse:
        credentials = tls_credentials(
            pki / f"{ca}.crt",
            pki / f"{cert}.crt" if cert else None,
            pki / f"{cert}.key" if cert else None,
        )
        channel = make_channel(service.target, default_timeout_s=10, credentials=credentials)
        async with channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            return await stub.Score(request)

    async def scenario() -> None:
        response = await call("team-a")
        assert response.results[0].status == common_pb2.REWARD_STATUS_OK
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call("team-a")  # the quota of CN team-a: one request per minute
        assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'team-a'" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call("team-c")  # a valid certificate, but not an accepted principal
        assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
        for cert in (None, "rogue"):  # no certificate, or one the service's CA did not sign
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call(cert)
            assert error.value.code() is grpc.StatusCode.UNAVAILABLE

    try:
        asyncio.run(scenario())
        assert service.alive()
    finally:
        service.kill()


def test_mtls_auth_without_client_certificates_is_a_config_error(tmp_path: Path) -> None:
    from relayrl.core.config import ConfigError, load_config
    from relayrl.reward.config import RewardConfig

    path = tmp_path / "c.yaml"
    path.write_text("auth:\n  type: mtls\n")
    with pytest.raises(ConfigError, match=r"mtls needs grpc\.tls"):
        load_config(RewardConfig, path, "RELAYRL_REWARD", {})
