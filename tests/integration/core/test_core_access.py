"""Who may call what, on a real grpc.aio server with the standard interceptor chain: every
method of the four services behind a static tokens file, allowed to the roles of
relayrl.core.access and refused to everyone else; the tokens weight-sync mints for one load;
the client sections' TLS and tokens, over real channels (asyncio and blocking)."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf.descriptor import MethodDescriptor
from prometheus_client import CollectorRegistry

from relayrl.core.access import ACCESS, ENGINE, ROLES
from relayrl.core.config import ConfigError, GrpcClientConfig, ServiceConfig, load_config
from relayrl.core.grpc_client import ClientIdentity, channel_from_config, sync_channel
from relayrl.core.grpc_server import GrpcService, build_service
from relayrl.core.interceptors import ANY_PRINCIPAL, MintedTokens, token_digest
from relayrl.core.service_process import console_script
from relayrl.proto.reward.v1 import reward_pb2_grpc
from relayrl.proto.rollout.v1 import rollout_pb2_grpc
from relayrl.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from relayrl.proto.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from relayrl_testkit.helpers.fuzz import Case, send
from relayrl_testkit.helpers.pki import make_ca, make_cert, mutual_tls_server
from relayrl_testkit.helpers.trust import (
    call,
    empty_request,
    knock_everywhere,
    method_path,
    service_descriptors,
)

TOKENS = {role: f"{role}-token-{'x' * 20}" for role in ROLES}
ADD_SERVICER = {
    "reward": reward_pb2_grpc.add_RewardServiceServicer_to_server,
    "gateway": rollout_pb2_grpc.add_RolloutGatewayServicer_to_server,
    "weightsync": weightsync_pb2_grpc.add_WeightSyncServicer_to_server,
    "trainer": trainer_pb2_grpc.add_TrainerServicer_to_server,
}


def reaching(service: str) -> Callable[[grpc.aio.Server], None]:
    """Registers a servicer of `service` whose every method answers UNIMPLEMENTED: a call
    that gets that far was let through by the interceptors, which are what this module tests."""

    def handler(method: MethodDescriptor) -> Callable[..., Any]:
        async def unary(self: object, request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "reached the handler")

        async def stream(self: object, request: object, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "reached the handler")
            yield  # an async generator, as streaming handlers are

        return stream if method.server_streaming else unary

    descriptor = service_descriptors()[service]
    servicer = type("Reaching", (), {m.name: handler(m) for m in descriptor.methods})()
    return lambda server: ADD_SERVICER[service](servicer, server)


class ServerThread:
    """A GrpcService on its own event loop in a thread, so blocking clients can call it."""

    def __init__(self, service: GrpcService) -> None:
        self.service = service
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self.service.start())
        self._started.set()
        self._loop.run_forever()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._started.wait(30), "the server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(0), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.service.port}"


def serve_all_four(
    tmp_path: Path, *, minted: MintedTokens | None = None, extra: dict | None = None
) -> ServerThread:
    """One server with the four services' base servicers and tables, its callers checked
    against a tokens file of digests."""
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(yaml.safe_dump({p: token_digest(t) for p, t in TOKENS.items()}))
    config = ServiceConfig.model_validate(
        {
            "metrics": {"enabled": False},
            "auth": {"type": "static_token", "tokens_file": str(tokens_file)} | (extra or {}),
        }
    )
    service = build_service(
        config,
        service_name="accesstest",
        register=[reaching(name) for name in ADD_SERVICER],
        service_names=[d.full_name for d in service_descriptors().values()],
        registry=CollectorRegistry(),
        access=list(ACCESS.values()),
        minted=minted,
    )
    return ServerThread(service)


def as_(principal: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[principal]}")]


def test_every_rpc_of_every_service_has_a_line_in_its_access_table() -> None:
    for name, descriptor in service_descriptors().items():
        assert set(ACCESS[name].methods) == set(descriptor.methods_by_name), name
        for method, roles in ACCESS[name].methods.items():
            assert roles and roles <= {*ROLES, ANY_PRINCIPAL}, (name, method, roles)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with serve_all_four(tmp_path_factory.mktemp("four")) as server:
        yield server


def test_each_method_lets_its_roles_through_and_refuses_every_other_caller(
    four: ServerThread,
) -> None:
    descriptors = service_descriptors()
    with grpc.insecure_channel(four.target) as channel:
        for name, descriptor in descriptors.items():
            for method in descriptor.methods:
                allowed = ACCESS[name].methods[method.name]
                for role in ROLES:
                    status = call(channel, method, empty_request(method), as_(role))
                    expected = (
                        grpc.StatusCode.UNIMPLEMENTED
                        if ANY_PRINCIPAL in allowed or role in allowed
                        else grpc.StatusCode.PERMISSION_DENIED
                    )
                    assert status == expected, (method_path(method), role, status)
    report = knock_everywhere(dict.fromkeys(descriptors, four.target), TOKENS)
    assert report.unauth_accepted == [] and report.wrong_role_accepted == []
    # every method was tried without credentials and with an unknown token
    assert len(report.of_kind(anonymous=True)) == 2 * sum(
        len(d.methods) for d in descriptors.values()
    )


def test_refusals_name_what_to_send_and_whom_the_method_is_for(four: ServerThread) -> None:
    with grpc.insecure_channel(four.target) as channel:
        publish = weightsync_pb2_grpc.WeightSyncStub(channel).Publish
        request = weightsync_pb2.PublishRequest()
        with pytest.raises(grpc.RpcError) as anonymous:
            publish(request, timeout=5)
        with pytest.raises(grpc.RpcError) as engine:
            publish(request, timeout=5, metadata=as_("engine"))
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <token>" in anonymous.value.details()
    assert engine.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert engine.value.details() == (
        "/relayrl.proto.weightsync.v1.WeightSync/Publish is for trainer; 'engine' acts as engine"
    )


def test_roles_map_other_principals_onto_roles(tmp_path: Path) -> None:
    extra = {"roles": {"operator": ["trainer"]}}  # an operator acting as the trainer
    with (
        serve_all_four(tmp_path, extra=extra) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        with pytest.raises(grpc.RpcError) as publish:
            stub.Publish(weightsync_pb2.PublishRequest(), timeout=5, metadata=as_("operator"))
        with pytest.raises(grpc.RpcError) as status:
            trainer_pb2_grpc.TrainerStub(channel).GetStatus(
                trainer_pb2.GetStatusRequest(), timeout=5, metadata=as_("operator")
            )
    assert publish.value.code() == grpc.StatusCode.UNIMPLEMENTED  # reached the handler
    assert status.value.code() == grpc.StatusCode.PERMISSION_DENIED  # no longer an operator


def test_minted_tokens_are_good_for_their_role_until_revoked_or_expired(tmp_path: Path) -> None:
    now = [1000.0]
    minted = MintedTokens(clock=lambda: now[0])
    with (
        serve_all_four(tmp_path, minted=minted) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        methods = service_descriptors()["weightsync"].methods_by_name

        def status(method: str, token: str) -> grpc.StatusCode:
            metadata = [("authorization", f"Bearer {token}")]
            return call(channel, methods[method], empty_request(methods[method]), metadata)

        def plan(token: str) -> grpc.StatusCode:
            return status("GetBucketPlan", token)

        def publish(token: str) -> grpc.StatusCode:
            return status("Publish", token)

        token = minted.mint(ENGINE, ttl_s=60)
        assert plan(token) == grpc.StatusCode.UNIMPLEMENTED
        assert publish(token) == grpc.StatusCode.PERMISSION_DENIED
        minted.revoke(token)
        assert plan(token) == grpc.StatusCode.UNAUTHENTICATED
        token = minted.mint(ENGINE, ttl_s=60)
        now[0] += 61
        assert plan(token) == grpc.StatusCode.UNAUTHENTICATED
        assert minted.live_count() == 0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_cert(directory, "ca", "server", san="DNS:weightsync.relayrl.svc")
    make_cert(directory, "ca", "trainer")
    return directory


def test_client_sections_carry_tls_and_the_callers_token(pki: Path, tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(yaml.safe_dump({"trainer": token_digest(TOKENS["trainer"])}))
    server_config = ServiceConfig.model_validate(
        {
            "metrics": {"enabled": False},
            "grpc": {"tls": mutual_tls_server(pki)},
            "auth": {"type": "static_token", "tokens_file": str(tokens_file)},
        }
    )
    service = build_service(
        server_config,
        service_name="tlstest",
        register=[reaching("weightsync")],
        service_names=["relayrl.proto.weightsync.v1.WeightSync"],
        registry=CollectorRegistry(),
        access=[ACCESS["weightsync"]],
    )
    token_file = tmp_path / "trainer.token"
    token_file.write_text(TOKENS["trainer"] + "\n")
    with ServerThread(service) as server:
        client = GrpcClientConfig.model_validate(
            {
                "target": server.target,
                "tls": {
                    "ca_file": str(pki / "ca.crt"),
                    "cert_file": str(pki / "trainer.crt"),
                    "key_file": str(pki / "trainer.key"),
                    "server_name": "weightsync.relayrl.svc",
                },
                "token_file": str(token_file),
            }
        )
        identity = ClientIdentity.from_config(client, "publish")
        with sync_channel(server.target, identity, []) as channel:
            stub = weightsync_pb2_grpc.WeightSyncStub(channel)
            with pytest.raises(grpc.RpcError) as blocking:
                stub.Publish(weightsync_pb2.PublishRequest(), timeout=10)

        async def aio_call() -> grpc.StatusCode:
            channel = channel_from_config(client, label="publish")
            try:
                await weightsync_pb2_grpc.WeightSyncStub(channel).Publish(
                    weightsync_pb2.PublishRequest(), timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            finally:
                await channel.close()
            return grpc.StatusCode.OK

        aio_status = asyncio.run(aio_call())
        without_token = client.model_copy(update={"token_file": None})
        with (
            sync_channel(
                server.target, ClientIdentity.from_config(without_token, "x"), []
            ) as channel,
            pytest.raises(grpc.RpcError) as anonymous,
        ):
            weightsync_pb2_grpc.WeightSyncStub(channel).Publish(
                weightsync_pb2.PublishRequest(), timeout=10
            )
    # TLS verified both ways and the token named the trainer: the handler was reached
    assert blocking.value.code() == grpc.StatusCode.UNIMPLEMENTED, blocking.value.details()
    assert aio_status == grpc.StatusCode.UNIMPLEMENTED
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"token_file": "{dir}/missing.token"}, "missing.token (publish.token_file): cannot read"),
        ({"token_file": "{dir}/short.token"}, "short.token (publish.token_file): the token must"),
        ({"token_env": "NO_SUCH_VAR"}, "env NO_SUCH_VAR (publish.token_env): variable is not set"),
        ({"tls": {"ca_file": "{dir}/none.crt"}}, "none.crt (publish.tls.ca_file): cannot read"),
    ],
)  # fmt: skip
def test_a_client_credential_that_cannot_work_is_one_line_naming_the_field(
    tmp_path: Path, section: dict, message: str
) -> None:
    (tmp_path / "short.token").write_text("abc\n")
    text = yaml.safe_dump({"target": "127.0.0.1:1", **section}).replace("{dir}", str(tmp_path))
    client = GrpcClientConfig.model_validate(yaml.safe_load(text))
    with pytest.raises(ConfigError) as error:
        ClientIdentity.from_config(client, "publish", environ={})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_digest_in_the_tokens_file_must_be_a_sha256(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text("trainer: 'sha256:abc'\n")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump({"auth": {"type": "static_token", "tokens_file": str(tokens_file)}})
    )
    config = load_config(ServiceConfig, config_file, env_prefix="RELAYRL_TEST")
    with pytest.raises(
        ConfigError, match="digest of 'trainer' must be sha256: and 64 lowercase hex"
    ):
        build_service(
            config, service_name="x", register=[], service_names=[], registry=CollectorRegistry()
        )


@pytest.mark.parametrize("service", ["reward", "gateway", "weightsync"])
def test_a_bad_tokens_file_at_start_up_is_one_line_and_exit_code_1(
    tmp_path: Path, model_dir: Path, service: str
) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text("trainer: short\n")
    config = tmp_path / "config.yaml"
    own = {"gateway": {"tokenizer": str(model_dir), "engines": {"urls": ["http://127.0.0.1:9"]}}}
    auth = {"type": "static_token", "tokens_file": str(tokens_file)}
    config.write_text(yaml.safe_dump({"auth": auth, **own.get(service, {})}))
    done = subprocess.run(
        [console_script(f"relayrl-{service}"), "--config", str(config)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output, output
    (line,) = [x for x in output.splitlines() if "tokens.yaml" in x]
    assert "token of 'trainer' must be at least 16 characters" in line


def test_a_request_that_does_not_parse_is_refused_for_credentials_first(
    four: ServerThread,
) -> None:
    """An unauthenticated caller learns only that it may not call, not whether its message
    parses; an allowed caller is told its message is not valid."""
    descriptor = service_descriptors()["weightsync"]
    publish = descriptor.methods_by_name["Publish"]
    push = descriptor.methods_by_name["PushBuckets"]  # client streaming
    garbage = Case("garbage", (b"\xff\xff\xff\x01",))
    with grpc.insecure_channel(four.target) as channel:
        for method in (publish, push):
            assert send(channel, method, garbage, [], 5.0) == grpc.StatusCode.UNAUTHENTICATED
            assert send(channel, method, garbage, as_("engine"), 5.0) == (
                grpc.StatusCode.PERMISSION_DENIED
            )
        # (the stand-in PushBuckets handler never reads its stream, so only Publish here)
        assert send(channel, publish, garbage, as_("trainer"), 5.0) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
