"""Chart smoke test (issue #8): the rendered helm/relayrl chart, run as local processes.

`helm template` renders the cpu-demo scenario; every workload's containers run here with
exactly their rendered command, args and env (Service DNS names pointed at loopback, mount
paths at local folders; see chart_smoke.py), and every startup, readiness and liveness probe
must pass as the kubelet runs it. Before the services move to local ports, their own
`--print-config` shows that the chart's config makes them listen on the containerPorts the
probes and Services name. The negative cases show that the harness does report a broken
contract.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl_testkit.helpers.chart_smoke import ChartSmoke, render, static_problems

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "relayrl"
CPU_DEMO = CHART / "ci" / "cpu-demo-values.yaml"
RELEASE, NAMESPACE = "smoke", "default"
FULLNAME = f"{RELEASE}-relayrl"
# How long the first prompt group may take to go round the pipeline once every pod is ready,
# and then how long the trainer gets for its first step.
PIPELINE_CAP_S = 120.0
FIRST_STEP_CAP_S = 120.0


@pytest.fixture(scope="module")
def cpu_demo(deploy_tools) -> list[dict[str, Any]]:
    return render(deploy_tools.helm, CHART, [CPU_DEMO], release=RELEASE, namespace=NAMESPACE)


@pytest.fixture
def local_root() -> Iterator[Path]:
    # Short on purpose: vLLM puts ipc sockets below the engine's cache folder (107-byte limit).
    root = Path(tempfile.mkdtemp(prefix="cs-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def report(smoke: ChartSmoke) -> str:
    lines = ["problems:", *(f"  {p}" for p in dict.fromkeys(smoke.problems))]
    lines += ["notes:", *(f"  {n}" for n in smoke.notes)]
    lines += ["start order: " + " -> ".join(smoke.start_order)]
    lines += ["probes:", *(f"  {r.line()}" for r in smoke.probe_results)]
    failing = {(r.pod, r.container) for r in smoke.probe_results if not r.ok}
    for process in smoke.processes:
        plan = smoke.plans[f"{process.pod}/{process.container}"]
        if plan.init or plan.pod in smoke.test_pods:
            continue
        if not process.alive() or (process.pod, process.container) in failing:
            lines += [f"--- log of {process.pod}/{process.container}:", process.log_tail(2000)]
    return "\n".join(lines)


def operator_token(smoke: ChartSmoke) -> str:
    """The operator's token from the chart's identities Secret (GetStatus is an operator's)."""
    secret = next(
        o for o in smoke.objects
        if o["kind"] == "Secret" and o["metadata"]["name"] == f"{FULLNAME}-identities"
    )  # fmt: skip
    return str(secret["stringData"]["operator.token"])


def trainer_step(port: int, token: str) -> tuple[int, str, int]:
    import grpc

    from relayrl.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        status = trainer_pb2_grpc.TrainerStub(channel).GetStatus(
            trainer_pb2.GetStatusRequest(),
            timeout=10,
            metadata=[("authorization", f"Bearer {token}")],
        )
    return (
        status.step,
        trainer_pb2.TrainerState.Name(status.state),
        status.published_version.version,
    )


def tq_groups(smoke: ChartSmoke) -> dict[str, int]:
    """Prompt groups by status in the trainer's partition, read from the local Redis with the
    chart's own password and namespace."""
    from relayrl.tq import TQConfig, TransferQueue

    trainer = yaml.safe_load(
        next(
            o for o in smoke.objects
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{FULLNAME}-trainer"
        )["data"]["config.yaml"]
    )  # fmt: skip
    password = smoke.plans[f"{FULLNAME}-trainer-0/trainer"].env[trainer["tq"]["password_env"]]
    url = f"redis://:{password}@127.0.0.1:{smoke.local_port('redis', 'redis')}/0"
    config = TQConfig(url=url, namespace=trainer["tq"]["namespace"], partitions=[])
    counts = TransferQueue.from_config(config).counts(trainer["data"]["partition"])
    return {status.value: n for status, n in counts.groups.items()}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_cpu_demo_chart_runs_and_every_probe_passes(cpu_demo, local_root, capsys) -> None:
    started = time.monotonic()
    with ChartSmoke(cpu_demo, local_root, start_cap_s=300.0, probe_cap_s=60.0) as smoke:
        assert {p.component for p in smoke.pods} >= {
            "redis", "reward", "engine", "gateway", "weightsync", "trainer",
        }  # fmt: skip
        assert not smoke.problems, report(smoke)  # static: probes, Services, env, volumes

        smoke.up()
        assert not smoke.problems, report(smoke)
        # Every pod started after the pods it addresses had passed their startup probes.
        order = smoke.start_order
        for pod, depends in smoke.depends.items():
            if pod in order:
                assert all(order.index(d) < order.index(pod) for d in depends), order

        results = smoke.probe_all()
        kinds = {(r.pod, r.container, r.kind) for r in results}
        for pod in smoke.pods:
            for container in pod.containers():
                assert (pod.name, container["name"], "readinessProbe") in kinds, pod.name
                assert (pod.name, container["name"], "livenessProbe") in kinds, pod.name
        assert all(r.ok for r in results), report(smoke)

        # The chart's own `helm test` pod, run against the same processes.
        for key, code, log in smoke.run_test_pods(timeout_s=60):
            assert code == 0, f"helm test container {key} exited {code}:\n{log}"

        # Prometheus reaches every ServiceMonitor endpoint.
        scrapes = smoke.scrape_service_monitors()
        assert scrapes and all(ok for _, ok, _ in scrapes), scrapes

        # The addresses in the configs work, not only the probes': prompt groups go round
        # trainer -> Redis -> gateway -> engine -> reward-service -> trainer.
        deadline = time.monotonic() + PIPELINE_CAP_S
        while tq_groups(smoke).get("consumed", 0) < 1 and time.monotonic() < deadline:
            time.sleep(2)
        groups = tq_groups(smoke)
        assert groups.get("consumed", 0) >= 1, f"{groups}\n{report(smoke)}"
        step, state, version = trainer_step(
            smoke.local_port("trainer", "grpc"), operator_token(smoke)
        )
        deadline = time.monotonic() + FIRST_STEP_CAP_S
        while version < 1 and state != "TRAINER_STATE_FAILED" and time.monotonic() < deadline:
            time.sleep(2)
            step, state, version = trainer_step(
                smoke.local_port("trainer", "grpc"), operator_token(smoke)
            )
        groups = tq_groups(smoke)

        # Still live after the pipeline has run.
        relive = [smoke.probe(smoke.plans[f"{r.pod}/{r.container}"], r.kind) for r in results]
        assert all(r.ok for r in relive if r.kind == "livenessProbe"), report(smoke)

        stopped = smoke.down()
        late = [(key, code, round(s, 1)) for key, code, s, in_grace in stopped if not in_grace]
        assert not late, f"not stopped within terminationGracePeriodSeconds: {late}"
    with capsys.disabled():
        print(f"\nchart smoke: {time.monotonic() - started:.0f} s\n{report(smoke)}")
        print("scrapes:", *(f"  {'PASS' if ok else 'FAIL'} {w}: {d}" for w, ok, d in scrapes))
        print("stopped:", [(k, c, round(s, 1)) for k, c, s, _ in stopped])
        print(f"trainer: step {step}, published version {version} ({state}); groups {groups}")
    # a step trained and its weights published through weight-sync to the engine
    assert step >= 1 and version >= 1, f"trainer: step {step}, version {version} ({state})"


# -- the harness reports a broken contract -----------------------------------------------------


def _workload(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def test_a_probe_on_an_undeclared_port_is_reported(cpu_demo) -> None:
    objects = copy.deepcopy(cpu_demo)
    gateway = _container(_workload(objects, "Deployment", f"{FULLNAME}-gateway"))
    gateway["readinessProbe"] = {"grpc": {"port": 50052}, "periodSeconds": 1}
    problems = static_problems(objects, NAMESPACE)
    assert any("gateway" in p and "readinessProbe" in p and "50052" in p for p in problems), (
        problems
    )
    assert not static_problems(cpu_demo, NAMESPACE)


def test_a_service_targeting_an_undeclared_port_is_reported(cpu_demo) -> None:
    objects = copy.deepcopy(cpu_demo)
    service = _workload(objects, "Service", f"{FULLNAME}-reward")
    service["spec"]["ports"][0]["targetPort"] = "grpcx"
    problems = static_problems(objects, NAMESPACE)
    assert any(f"Service {FULLNAME}-reward" in p and "grpcx" in p for p in problems), problems


def test_a_config_port_that_differs_from_the_container_port_is_reported(
    cpu_demo, local_root
) -> None:
    """The reward-service's config says 50052 while its container, probes and Service say
    50051: --print-config exposes it before anything runs."""
    objects = copy.deepcopy(cpu_demo)
    configmap = _workload(objects, "ConfigMap", f"{FULLNAME}-reward")
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    config["grpc"]["port"] = 50052
    configmap["data"]["config.yaml"] = yaml.safe_dump(config)
    with ChartSmoke(objects, local_root, components=["reward"]) as smoke:
        plan = smoke.plans[f"{FULLNAME}-reward-local/reward"]
        smoke.prove_listen_ports(plan)
        assert any(
            "grpc.port is 50052" in p and "containerPort 'grpc' is 50051" in p
            for p in smoke.problems
        ), smoke.problems


def test_an_address_to_a_port_the_service_does_not_expose_is_reported(cpu_demo, local_root) -> None:
    objects = copy.deepcopy(cpu_demo)
    configmap = _workload(objects, "ConfigMap", f"{FULLNAME}-trainer")
    configmap["data"]["config.yaml"] = configmap["data"]["config.yaml"].replace(
        f"{FULLNAME}-weightsync.{NAMESPACE}.svc.cluster.local:50051",
        f"{FULLNAME}-weightsync.{NAMESPACE}.svc.cluster.local:50061",
    )
    with ChartSmoke(objects, local_root, components=["trainer"]) as smoke:
        assert any(
            "50061" in p and f"Service {FULLNAME}-weightsync exposes no port" in p
            for p in smoke.problems
        ), smoke.problems


@pytest.mark.timeout(120)
def test_a_probe_that_nothing_answers_fails(cpu_demo, local_root) -> None:
    """Redis alone, with a readiness probe on a declared port nothing listens on: the probe
    fails within its own budget while the chart's real probes pass."""
    objects = copy.deepcopy(cpu_demo)
    redis = _container(_workload(objects, "StatefulSet", f"{FULLNAME}-redis"))
    redis["ports"].append({"name": "exporter", "containerPort": 9121, "protocol": "TCP"})
    redis["readinessProbe"] = {
        "tcpSocket": {"port": "exporter"},
        "periodSeconds": 1,
        "failureThreshold": 2,
        "timeoutSeconds": 1,
    }
    with ChartSmoke(objects, local_root, components=["redis"]) as smoke:
        smoke.up()
        # The exporter port is declared, but nothing in the command makes redis listen there.
        assert any("exporter=9121" in p for p in smoke.problems), smoke.problems
        results = {r.kind: r for r in smoke.probe_all()}
        assert results["startupProbe"].ok, results["startupProbe"].line()
        assert results["livenessProbe"].ok, results["livenessProbe"].line()
        failed = results["readinessProbe"]
        # given up within its own budget (failureThreshold 2, one try per second), not retried on
        assert not failed.ok and 2 <= failed.attempts <= 3, failed.line()
        stopped = smoke.down()
    assert stopped and all(in_grace for *_, in_grace in stopped), stopped
