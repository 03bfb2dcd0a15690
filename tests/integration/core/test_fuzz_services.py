"""Bad input on every gRPC method of the four services, each a real process: requests
generated from the proto descriptors (relayrl_testkit.helpers.fuzz: empty, random and boundary
values, huge fields, truncated and random bytes, another method's message), a bounded number
per method. No case may end in UNKNOWN or INTERNAL (a handler that raised) or take the service
down; each is healthy afterwards. The services run without authentication here, so every case
reaches a handler (`make bench-trust` runs the same against an authenticated `relayrl up`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.core.ports import free_port
from relayrl.core.service_process import ServiceProcess
from relayrl.gateway.config import AgentHttpConfig
from relayrl.proto.trainer.v1 import trainer_pb2
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.fuzz import Case, decodes_as, fuzz_http, fuzz_service
from relayrl_testkit.helpers.trainer import trainer_config
from relayrl_testkit.helpers.trust import service_descriptors

CASES_PER_METHOD = 24  # four rounds of the six kinds
AGENT_PORT = free_port()


def stops_the_trainer(method: object, case: Case) -> bool:
    """A Control(STOP) that parses is the trainer being told to end: not a case of bad input."""
    if getattr(method, "name", "") != "Control":
        return False
    request = decodes_as(method, case)  # type: ignore[arg-type]
    return request is not None and request.action == trainer_pb2.CONTROL_ACTION_STOP


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[dict[str, ServiceProcess]]:
    root = tmp_path_factory.mktemp("fuzz")
    redis = RedisServer(root / "redis")
    redis.start()
    configs = {
        "reward": ("relayrl-reward", {"tq": {"url": redis.url}, "tq_scorer": {"enabled": False}}),
        "weightsync": ("relayrl-weightsync", {"state_dir": str(root / "ws-state")}),
        "gateway": (
            "relayrl-gateway",
            {
                "tq": {"url": redis.url},
                "tokenizer": str(model_dir),
                "engines": {"urls": ["http://127.0.0.1:9"], "health_interval_s": 0.5},
                "rollout_shape": {"batch_groups": 2, "eta": 0},
                "agent_http": {"enabled": True, "port": AGENT_PORT, "adhoc_sessions": True},
            },
        ),
        "trainer": (
            "relayrl-trainer",
            trainer_config(redis, model_dir, root, total_steps=1000),
        ),
    }
    started: dict[str, ServiceProcess] = {}
    try:
        for name, (command, config) in configs.items():
            started[name] = ServiceProcess(command, config, root / name).start(timeout_s=180)
        yield started
    finally:
        for process in started.values():
            process.kill()
        redis.kill()


@pytest.mark.parametrize("service", ["reward", "weightsync", "gateway", "trainer"])
def test_bad_input_never_crashes_a_service(
    services: dict[str, ServiceProcess], service: str
) -> None:
    process = services[service]
    methods = list(service_descriptors()[service].methods)
    report = fuzz_service(
        process.target,
        methods,
        per_method=CASES_PER_METHOD,
        seed=20,
        skip=stops_the_trainer,
        timeout_s=3.0,
        service=service,
    )
    assert report.cases >= CASES_PER_METHOD * len(methods) - CASES_PER_METHOD  # few skipped
    assert report.crashes == [], report.crashes
    # the cases reached the handlers: refusals naming a field, not only parse errors
    assert report.statuses.get("INVALID_ARGUMENT", 0) + report.statuses.get("OK", 0) > 0
    assert process.alive(), process.log()[-2000:]
    with grpc.insecure_channel(process.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_bad_input_on_every_agent_http_route_is_a_4xx_in_openais_error_format(
    services: dict[str, ServiceProcess],
) -> None:
    gateway = services["gateway"]
    limit = AgentHttpConfig.model_fields["max_request_bytes"].default
    report = fuzz_http(
        f"http://127.0.0.1:{AGENT_PORT}",
        per_route=CASES_PER_METHOD,
        seed=20,
        max_request_bytes=limit,
    )
    assert report.crashes == [], report.crashes
    assert report.nonconforming == [], report.nonconforming
    assert report.cases == CASES_PER_METHOD * 10
    assert {"400", "404", "413"} <= set(report.statuses), report.statuses
    assert gateway.alive(), gateway.log()[-2000:]
