"""Run a rendered Helm chart's workloads as local processes and probe them as the kubelet would.

The chart smoke test (issue #8) renders helm/relayrl, takes every workload's containers as they
are rendered (command, args, env, volume mounts, probes) and runs them here:

- ports: each declared containerPort gets a free loopback port; every Service DNS name (short,
  `.ns`, `.ns.svc`, `.ns.svc.cluster.local`, StatefulSet pod names behind a headless Service,
  with or without `dns:///`) followed by a port becomes `127.0.0.1:<local port>`, resolved the
  way cluster networking does (ClusterIP Service port -> targetPort -> the selected pod's
  containerPort; a headless Service or a pod name -> the containerPort itself);
- volumes: ConfigMaps and Secrets are written to local folders, emptyDirs and PVCs are local
  folders, and every absolute mount path in command, args, env, probe commands and mounted
  ConfigMap files is rewritten to its local folder;
- env: `value`, `valueFrom` (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef) and
  `envFrom`, then Kubernetes' `$(VAR)` expansion in env values, command and args.

Before a relayrl service is moved to its local ports, `--print-config` (the engine:
`--print-command`) is run with the chart's own config and env, proving that they make it listen
on the containerPorts its probes and Services name; the local ports are then set through the
same `RELAYRL_<SVC>__<SECTION>__PORT` overrides. Pods start in the order their references
imply (a pod starts once every pod it addresses has passed its startup probe), each container a
real process leading its own process group, stopped by PID with SIGTERM and then SIGKILL after
the pod's terminationGracePeriodSeconds, as the kubelet does.

Probes run as the kubelet runs them: `grpc` is a grpc.health.v1 Check (plaintext, the probe's
service name), `httpGet` a GET without proxies where 200-399 passes, `tcpSocket` a connect,
`exec` the (rewritten) command with the container's env and `timeoutSeconds`; each is retried
until it passes or its own budget (initialDelaySeconds + failureThreshold x periodSeconds,
capped) runs out.

What cannot run here is replaced, and said so where it happens: Kubernetes EndpointSlice
discovery of the engines (no API server) becomes the engine URLs the EndpointSlices would
list; only replica 0 of each workload runs.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relayrl.core.ports import free_port

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
PROBE_KINDS = ("startupProbe", "readinessProbe", "livenessProbe")
CLUSTER_SUFFIXES = ("", ".{ns}", ".{ns}.svc", ".{ns}.svc.cluster.local")
ALL_INTERFACES = ("0.0.0.0", "::", "[::]", "")
LOOPBACK = "127.0.0.1"

# The listening contract of each relayrl service (issue #8 conventions): containerPort name ->
# the config section that holds its `host` and `port` (the engine's are top-level fields).
LISTENERS: dict[str, dict[str, tuple[str, ...]]] = {
    "gateway": {"grpc": ("grpc",), "metrics": ("metrics",), "agent": ("agent_http",)},
    "reward": {"grpc": ("grpc",), "metrics": ("metrics",)},
    "weightsync": {"grpc": ("grpc",), "metrics": ("metrics",)},
    "trainer": {"grpc": ("grpc",), "metrics": ("metrics",)},
    "engine": {"http": ()},
}
# torch.distributed's rendezvous on trainer rank 0: MASTER_PORT, not a config field.
RENDEZVOUS_PORT_NAME = "rendezvous"

_HOST_CHAR = r"A-Za-z0-9.\-"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_PORT_FLAG = re.compile(r"(?<![\w-])(-p|--port)(=|\s+)(\d{1,5})(?!\d)")
_LOCAL_ADDRESS = re.compile(
    r"(?<![\w.\-])(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\]|\[::\]):(\d{1,5})(?!\d)"
)


# -- rendering ---------------------------------------------------------------------------------


def render(
    helm: Path,
    chart: Path,
    values: Iterable[Path] = (),
    *,
    release: str = "smoke",
    namespace: str = "default",
    retries: int = 3,
) -> list[dict[str, Any]]:
    """`helm template` -> the rendered objects (a chart being edited may fail to render for a
    moment: retried after a pause)."""
    argv = [str(helm), "template", release, str(chart), "--namespace", namespace]
    for path in values:
        argv += ["-f", str(path)]
    for attempt in range(retries):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode == 0:
            return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        if attempt + 1 < retries:
            time.sleep(20)
    raise RuntimeError(f"helm template failed ({result.returncode}): {result.stderr[-2000:]}")


# -- the rendered objects ----------------------------------------------------------------------


@dataclass
class Pod:
    """Replica 0 of a workload (or a `helm test` Pod), as its controller would create it."""

    name: str
    workload: str  # Kind/name
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    subdomain: str | None = None  # a StatefulSet's serviceName
    claims: list[str] = field(default_factory=list)  # volumeClaimTemplates names

    @property
    def component(self) -> str:
        return self.labels.get("app.kubernetes.io/component", self.name)

    def containers(self, init: bool = False) -> list[dict[str, Any]]:
        return list(self.spec.get("initContainers" if init else "containers") or [])

    def container(self, name: str) -> dict[str, Any]:
        for container in self.containers() + self.containers(init=True):
            if container["name"] == name:
                return container
        raise KeyError(f"{self.name} has no container {name}")


def pods_of(objects: Iterable[Mapping[str, Any]], namespace: str) -> tuple[list[Pod], list[Pod]]:
    """(workload pods, `helm test` pods) of the rendered objects."""
    workloads, tests = [], []
    for obj in objects:
        kind, meta = obj.get("kind"), obj.get("metadata", {})
        ns = meta.get("namespace", namespace)
        if kind in WORKLOAD_KINDS:
            template = obj["spec"]["template"]
            labels = dict(template.get("metadata", {}).get("labels") or {})
            name = f"{meta['name']}-local"
            subdomain = None
            claims: list[str] = []
            if kind == "StatefulSet":
                # The labels the StatefulSet controller adds to pod 0.
                name = f"{meta['name']}-0"
                labels["statefulset.kubernetes.io/pod-name"] = name
                labels["apps.kubernetes.io/pod-index"] = "0"
                subdomain = obj["spec"].get("serviceName")
                claims = [
                    t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])
                ]
            workloads.append(
                Pod(
                    name=name,
                    workload=f"{kind}/{meta['name']}",
                    namespace=ns,
                    labels=labels,
                    annotations=dict(template.get("metadata", {}).get("annotations") or {}),
                    spec=copy.deepcopy(template["spec"]),
                    subdomain=subdomain,
                    claims=claims,
                )
            )
        elif kind == "Pod":
            annotations = dict(meta.get("annotations") or {})
            if annotations.get("helm.sh/hook") in ("test", "test-success"):
                tests.append(
                    Pod(
                        name=meta["name"],
                        workload=f"Pod/{meta['name']}",
                        namespace=ns,
                        labels=dict(meta.get("labels") or {}),
                        annotations=annotations,
                        spec=copy.deepcopy(obj["spec"]),
                    )
                )
    return workloads, tests


def _named(objects: Iterable[Mapping[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: dict(o) for o in objects if o.get("kind") == kind}


def _secret_data(secret: Mapping[str, Any]) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data |= {k: str(v).encode() for k, v in (secret.get("stringData") or {}).items()}
    return data


def _configmap_data(configmap: Mapping[str, Any]) -> dict[str, bytes]:
    data = {k: str(v).encode() for k, v in (configmap.get("data") or {}).items()}
    data |= {k: base64.b64decode(v) for k, v in (configmap.get("binaryData") or {}).items()}
    return data


def _selects(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_ports(container: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(container.get("ports") or [])


def find_container_port(container: Mapping[str, Any], port: int | str) -> int | None:
    """A probe's or Service's port (number or name) -> the declared containerPort, or None."""
    for declared in container_ports(container):
        if isinstance(port, str) and not port.isdigit():
            if declared.get("name") == port:
                return int(declared["containerPort"])
        elif int(declared["containerPort"]) == int(port):
            return int(declared["containerPort"])
    return None


def probe_port(probe: Mapping[str, Any]) -> tuple[str, int | str] | None:
    """(handler, port) of a grpc/httpGet/tcpSocket probe; None for exec."""
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return handler, probe[handler].get("port")
    return None


def static_problems(objects: list[dict[str, Any]], namespace: str = "default") -> list[str]:
    """Mismatches visible without running anything: probes on ports their container does not
    declare, Services that select no pod or target a port no selected container declares."""
    problems = []
    workloads, tests = pods_of(objects, namespace)
    for pod in workloads + tests:
        for container in pod.containers() + pod.containers(init=True):
            for kind in PROBE_KINDS:
                probe = container.get(kind)
                if not probe:
                    continue
                found = probe_port(probe)
                if found is None and "exec" not in probe:
                    problems.append(f"{pod.name}/{container['name']} {kind}: no handler")
                if found is None:
                    continue
                handler, port = found
                if handler == "grpc" and not isinstance(port, int):
                    problems.append(
                        f"{pod.name}/{container['name']} {kind}: grpc.port must be a number, "
                        f"not {port!r}"
                    )
                elif find_container_port(container, port) is None:
                    declared = [
                        (p.get("name"), p["containerPort"]) for p in container_ports(container)
                    ]
                    problems.append(
                        f"{pod.name}/{container['name']} {kind}: {handler} port {port!r} is not "
                        f"a port the container declares {declared}"
                    )
    for name, service in _named(objects, "Service").items():
        spec = service.get("spec", {})
        if spec.get("type") == "ExternalName":
            continue
        selected = [p for p in workloads if _selects(spec.get("selector"), p.labels)]
        if not selected:
            problems.append(f"Service {name} selects no pod (selector {spec.get('selector')})")
            continue
        for sp in spec.get("ports") or []:
            target = sp.get("targetPort", sp["port"])
            for pod in selected:
                if not any(find_container_port(c, target) for c in pod.containers()):
                    problems.append(
                        f"Service {name} port {sp.get('name')}:{sp['port']} targets "
                        f"{target!r}, which no container of {pod.name} declares"
                    )
    return problems


# -- processes and probes ----------------------------------------------------------------------


@dataclass
class LocalProcess:
    """One container's process, leading its own process group (vLLM and the trainer start
    children), stopped by PID."""

    pod: str
    container: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def stop(self, grace_s: float) -> tuple[int | None, float, bool]:
        """SIGTERM to the container's main process, SIGKILL to its group after `grace_s` (the
        kubelet's terminationGracePeriodSeconds); then whatever is left of the group goes, as
        when a container is torn down. (exit code, seconds to exit, exited within grace)."""
        if self.process is None:
            return None, 0.0, True
        started = time.monotonic()
        in_grace = True
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                in_grace = False
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode, time.monotonic() - started, in_grace


@dataclass
class ProbeResult:
    pod: str
    container: str
    kind: str  # startupProbe / readinessProbe / livenessProbe
    handler: str  # what was checked, with the chart's and the local port
    ok: bool
    attempts: int
    elapsed_s: float
    detail: str

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"{verdict} {self.pod}/{self.container} {self.kind}: {self.handler} "
            f"({self.attempts} tries, {self.elapsed_s:.1f} s) {self.detail}"
        )


def grpc_health_check(port: int, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{LOOPBACK}:{port}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        try:
            response = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def http_get_check(url: str, headers: Mapping[str, str], timeout_s: float) -> tuple[bool, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            code = response.status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{getattr(exc, 'reason', exc)}"
    return 200 <= code < 400, f"HTTP {code}"  # the kubelet's rule


def tcp_check(port: int, timeout_s: float) -> tuple[bool, str]:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout_s):
            return True, "connected"
    except OSError as exc:
        return False, str(exc)


# -- the harness -------------------------------------------------------------------------------


@dataclass
class ContainerPlan:
    """How one container runs here: rewritten argv, env and mounts, and its local ports."""

    pod: Pod
    container: dict[str, Any]
    init: bool
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the chart's env, rewritten
    overrides: dict[str, str] = field(default_factory=dict)  # local ports, discovery
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local path
    service: str | None = None  # gateway / reward / ... / engine, else None
    own_flags: set[int] = field(default_factory=set)  # containerPorts its argv names by flag

    @property
    def name(self) -> str:
        return self.container["name"]

    @property
    def key(self) -> str:
        return f"{self.pod.name}/{self.name}"


class ChartSmoke:
    """The rendered chart as local processes. Use as a context manager: every process it
    started is stopped on exit, whatever happened."""

    def __init__(
        self,
        objects: list[dict[str, Any]],
        root: Path,
        *,
        namespace: str = "default",
        components: Iterable[str] | None = None,
        start_cap_s: float = 300.0,
        probe_cap_s: float = 60.0,
        python_bin: Path = Path(sys.executable).parent,
    ) -> None:
        """`components`: run only the pods with these app.kubernetes.io/component labels
        (default: all). `start_cap_s` caps a startup probe's budget, `probe_cap_s` the budget
        of readiness and liveness probes (their own budget when smaller)."""
        self.objects = objects
        self.root = root
        self.namespace = namespace
        self.start_cap_s, self.probe_cap_s = start_cap_s, probe_cap_s
        self.python_bin = python_bin
        self.configmaps = _named(objects, "ConfigMap")
        self.secrets = _named(objects, "Secret")
        self.services = _named(objects, "Service")
        self.roles = _named(objects, "Role")
        self.rolebindings = _named(objects, "RoleBinding")
        all_pods, self.test_pods = pods_of(objects, namespace)
        self.all_pods = all_pods
        wanted = set(components) if components is not None else None
        self.pods = [p for p in all_pods if wanted is None or p.component in wanted]
        self.problems: list[str] = static_problems(objects, namespace)
        self.notes: list[str] = []
        self.local_ports: dict[tuple[str, str, int], int] = {}
        self.plans: dict[str, ContainerPlan] = {}
        self.depends: dict[str, set[str]] = {p.name: set() for p in all_pods + self.test_pods}
        self.processes: list[LocalProcess] = []
        self.start_order: list[str] = []
        self.probe_results: list[ProbeResult] = []
        self._lock = threading.Lock()
        self._hosts = self._hostnames()
        names = "|".join(re.escape(h) for h in sorted(self._hosts, key=len, reverse=True))
        self._host_re = re.compile(
            rf"(?<![{_HOST_CHAR}])(?P<host>{names or '(?!)'})"
            r"(?::(?P<port>\d{1,5}))?(?![A-Za-z0-9\-]|\.[A-Za-z0-9])"
        )
        self._allocate_ports()
        for pod in all_pods + self.test_pods:
            for init in (True, False):
                for container in pod.containers(init=init):
                    self.plans[f"{pod.name}/{container['name']}"] = self._plan(pod, container, init)

    # -- addresses ------------------------------------------------------------------------

    def _hostnames(self) -> dict[str, tuple[str, Any]]:
        """Every DNS name a pod can use for a Service or a StatefulSet pod -> what it names."""
        hosts: dict[str, tuple[str, Any]] = {}
        ns = self.namespace
        for name, service in self.services.items():
            for suffix in CLUSTER_SUFFIXES:
                hosts[name + suffix.format(ns=ns)] = ("service", service)
        for pod in self.all_pods:
            if pod.subdomain:
                for suffix in CLUSTER_SUFFIXES:
                    hosts[f"{pod.name}.{pod.subdomain}{suffix.format(ns=ns)}"] = ("pod", pod)
        return hosts

    def _allocate_ports(self) -> None:
        chart_ports = {
            int(p["containerPort"])
            for pod in self.all_pods
            for c in pod.containers()
            for p in container_ports(c)
        }
        chart_ports |= {
            int(sp["port"]) for s in self.services.values() for sp in s["spec"].get("ports", [])
        }
        # A local port never equals a chart port, so a rewritten address is never rewritten
        # again as if it were the chart's.
        avoid = set(chart_ports)
        for pod in self.all_pods:
            for container in pod.containers():
                for declared in container_ports(container):
                    key = (pod.name, container["name"], int(declared["containerPort"]))
                    self.local_ports[key] = free_port(avoid=avoid)

    def local_port(self, component: str, port: int | str) -> int:
        """The local port of a component's (replica 0) containerPort, by name or number."""
        for pod in self.all_pods:
            if pod.component != component:
                continue
            for container in pod.containers():
                number = find_container_port(container, port)
                if number is not None:
                    return self.local_ports[(pod.name, container["name"], number)]
        raise KeyError(f"{component} declares no port {port!r}")

    def _pod_port(self, pod: Pod, port: int | str, what: str) -> int | None:
        for container in pod.containers():
            number = find_container_port(container, port)
            if number is not None:
                return self.local_ports[(pod.name, container["name"], number)]
        self.problems.append(f"{what}: no container of {pod.name} declares port {port!r}")
        return None

    def _selected(self, service: Mapping[str, Any]) -> list[Pod]:
        return [p for p in self.all_pods if _selects(service["spec"].get("selector"), p.labels)]

    def resolve(self, host: str, port: int, what: str) -> tuple[int, Pod] | None:
        """`host:port` as a pod in the cluster dials it -> (local port, pod reached)."""
        kind, target = self._hosts[host]
        if kind == "pod":
            local = self._pod_port(target, port, f"{what} ({host}:{port})")
            return None if local is None else (local, target)
        spec = target["spec"]
        pods = self._selected(target)
        if not pods:
            self.problems.append(f"{what}: {host}:{port}: Service selects no pod")
            return None
        if spec.get("clusterIP") == "None":
            # Headless: the name resolves to the pods' own addresses; no port mapping.
            local = self._pod_port(pods[0], port, f"{what} ({host}:{port}, headless)")
            return None if local is None else (local, pods[0])
        for sp in spec.get("ports") or []:
            if int(sp["port"]) == port:
                target_port = sp.get("targetPort", sp["port"])
                local = self._pod_port(pods[0], target_port, f"{what} ({host}:{port})")
                return None if local is None else (local, pods[0])
        exposed = [(sp.get("name"), sp["port"]) for sp in spec.get("ports") or []]
        self.problems.append(
            f"{what}: {host}:{port}: Service {target['metadata']['name']} exposes no port "
            f"{port} (it exposes {exposed})"
        )
        return None

    # -- rewriting ------------------------------------------------------------------------

    def _rewrite(self, plan: ContainerPlan, text: str, what: str, state: dict[str, Any]) -> str:
        """Cluster addresses, the container's own ports and its mount paths in `text` ->
        their local equivalents. `state['bare']` carries a bare host (no port) to the port
        flags after it (`redis-cli -h HOST -p 6379`)."""

        def host(m: re.Match[str]) -> str:
            name, port = m.group("host"), m.group("port")
            if port is None:
                if "." not in name:
                    return name  # a bare short name is as likely a resource name as a host
                state["bare"] = name
                self._note_dependency(plan, self._hosts[name])
                return LOOPBACK
            resolved = self.resolve(name, int(port), f"{plan.key} {what}")
            if resolved is None:
                return m.group(0)
            local, target_pod = resolved
            self._depend(plan, target_pod)
            return f"{LOOPBACK}:{local}"

        text = self._host_re.sub(host, text)
        text = _LOCAL_ADDRESS.sub(lambda m: self._own(plan, m, int(m.group(1)), what), text)
        text = _PORT_FLAG.sub(
            lambda m: m.group(1) + m.group(2) + str(self._flag_port(plan, int(m.group(3)), state)),
            text,
        )
        return self._rewrite_paths(plan, text)

    def _own(self, plan: ContainerPlan, m: re.Match[str], port: int, what: str) -> str:
        local = self._own_port(plan, port)
        return m.group(0) if local is None else f"{LOOPBACK}:{local}"

    def _own_port(self, plan: ContainerPlan, port: int) -> int | None:
        """The local port of `port` on this pod: its own container's, else a sibling's (a
        probe or sidecar reaches the pod's other containers on localhost too)."""
        for container in plan.pod.containers():
            number = find_container_port(container, port)
            if number is not None:
                return self.local_ports[(plan.pod.name, container["name"], number)]
        return None

    def _flag_port(self, plan: ContainerPlan, port: int, state: dict[str, Any]) -> int:
        bare = state.get("bare")
        if bare is not None:
            resolved = self.resolve(bare, port, f"{plan.key} -p after {bare}")
            if resolved is not None:
                return resolved[0]
            return port
        local = self._own_port(plan, port)
        if local is None:
            self.problems.append(
                f"{plan.key}: port flag {port} names no containerPort of {plan.pod.name}"
            )
            return port
        if "own_flags" in state:
            state["own_flags"].add(port)
        return local

    def _rewrite_paths(self, plan: ContainerPlan, text: str) -> str:
        if not plan.mounts:
            return text
        # One pass, longest mount first: a local path is never rewritten again.
        names = "|".join(re.escape(m) for m in sorted(plan.mounts, key=len, reverse=True))
        pattern = rf"(?<![\w.~/\-])(?:{names})(?=$|/|[^\w.\-])"
        return re.sub(pattern, lambda m: str(plan.mounts[m.group(0)]), text)

    def _rewrite_argv(self, plan: ContainerPlan, argv: list[str], what: str) -> list[str]:
        listening = what in ("command", "args")
        state: dict[str, Any] = {"own_flags": plan.own_flags} if listening else {}
        out: list[str] = []
        flag_next = False
        for arg in argv:
            if flag_next and arg.isdigit():
                out.append(str(self._flag_port(plan, int(arg), state)))
                flag_next = False
                continue
            flag_next = arg in ("-p", "--port")
            if any(ch.isspace() for ch in arg):  # a shell script: a command of its own
                script_state = {"own_flags": plan.own_flags} if listening else {}
                out.append(self._rewrite(plan, arg, what, script_state))
            else:
                out.append(self._rewrite(plan, arg, what, state))
        return out

    def _depend(self, plan: ContainerPlan, target: Pod) -> None:
        """`plan`'s pod starts after `target`'s, unless `target` already waits for it: two
        pods that address each other start together, as Kubernetes starts them (each must
        then wait for the other by itself)."""
        if target.name == plan.pod.name or target.name in self.depends[plan.pod.name]:
            return
        if self._waits_for(target.name, plan.pod.name):
            note = f"{plan.pod.name} and {target.name} address each other: started together"
            if note not in self.notes:
                self.notes.append(note)
            return
        self.depends[plan.pod.name].add(target.name)

    def _waits_for(self, pod: str, other: str) -> bool:
        """Whether `pod` starts only after `other` (directly or through others)."""
        seen, todo = set(), [pod]
        while todo:
            current = todo.pop()
            if current == other:
                return True
            if current not in seen:
                seen.add(current)
                todo.extend(self.depends.get(current, ()))
        return False

    def _note_dependency(self, plan: ContainerPlan, target: tuple[str, Any]) -> None:
        kind, obj = target
        for pod in [obj] if kind == "pod" else self._selected(obj):
            self._depend(plan, pod)

    # -- env and volumes ------------------------------------------------------------------

    def _field_ref(self, pod: Pod, path: str) -> str:
        simple = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "metadata.uid": f"local-{pod.name}",
            "spec.nodeName": "local-node",
            "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
            "status.podIP": LOOPBACK,
            "status.podIPs": LOOPBACK,
            "status.hostIP": LOOPBACK,
        }
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            source = pod.labels if m.group(1) == "labels" else pod.annotations
            return source.get(m.group(2), "")
        raise ValueError(f"fieldRef {path} is not supported by the smoke test")

    def _resource_ref(self, container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
        what, _, name = ref["resource"].partition(".")
        value = str((container.get("resources") or {}).get(what, {}).get(name, "0"))
        divisor = str(ref.get("divisor", "1"))
        return str(math.ceil(_quantity(value) / _quantity(divisor)))

    def _env(self, pod: Pod, container: Mapping[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it (envFrom, then env in order
        with `$(VAR)` expansion), before any rewriting."""
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                ref, data = source["configMapRef"], self.configmaps
                items = _configmap_data(data[ref["name"]]) if ref["name"] in data else None
            else:
                ref, data = source["secretRef"], self.secrets
                items = _secret_data(data[ref["name"]]) if ref["name"] in data else None
            if items is None:
                if not ref.get("optional"):
                    self.problems.append(f"{pod.name}: envFrom {ref['name']} is not rendered")
                continue
            env |= {prefix + k: v.decode() for k, v in items.items()}
        for var in container.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                env[name] = expand(str(var.get("value", "")), env)
                continue
            source = var["valueFrom"]
            if "secretKeyRef" in source or "configMapKeyRef" in source:
                is_secret = "secretKeyRef" in source
                ref = source["secretKeyRef" if is_secret else "configMapKeyRef"]
                store = self.secrets if is_secret else self.configmaps
                obj = store.get(ref["name"])
                data = (
                    (_secret_data(obj) if is_secret else _configmap_data(obj))
                    if obj is not None
                    else {}
                )
                if ref["key"] in data:
                    env[name] = data[ref["key"]].decode()
                elif not ref.get("optional"):
                    self.problems.append(
                        f"{pod.name}/{container['name']} env {name}: "
                        f"{'Secret' if is_secret else 'ConfigMap'} {ref['name']} has no key "
                        f"{ref['key']} (or is not rendered)"
                    )
            elif "fieldRef" in source:
                env[name] = self._field_ref(pod, source["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in source:
                env[name] = self._resource_ref(container, source["resourceFieldRef"])
        return env

    def _mounts(self, pod: Pod, container: Mapping[str, Any]) -> dict[str, Path]:
        """mountPath -> local path; materializes the volumes (a ConfigMap's files are written
        later, once the mount table exists, because their contents are rewritten with it)."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes") or []}
        pod_dir = self.root / _short(pod.name)
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            name = mount["name"]
            volume = volumes.get(name)
            if volume is None and name in pod.claims:
                base = pod_dir / f"pvc-{name}"
            elif volume is None:
                self.problems.append(f"{pod.name}/{container['name']}: no volume {name}")
                continue
            elif "configMap" in volume or "secret" in volume or "projected" in volume:
                base = pod_dir / _short(container["name"]) / name
            elif "emptyDir" in volume or "persistentVolumeClaim" in volume:
                base = pod_dir / name
            else:
                self.problems.append(
                    f"{pod.name}: volume {name} ({sorted(volume)}) cannot be mapped locally"
                )
                continue
            base.mkdir(parents=True, exist_ok=True)
            sub = mount.get("subPath")
            mounts[mount["mountPath"].rstrip("/") or "/"] = base / sub if sub else base
        return mounts

    def _write_volume_files(self, plan: ContainerPlan) -> None:
        volumes = {v["name"]: v for v in plan.pod.spec.get("volumes") or []}
        pod_dir = self.root / _short(plan.pod.name)
        for mount in plan.container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                continue
            sources = (volume.get("projected") or {}).get("sources") or [volume]
            base = pod_dir / _short(plan.name) / mount["name"]
            for source in sources:
                files = self._volume_files(plan, source)
                for rel, content in files.items():
                    path = base / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(content)

    def _volume_files(self, plan: ContainerPlan, source: Mapping[str, Any]) -> dict[str, bytes]:
        if "configMap" in source:
            ref, obj = source["configMap"], self.configmaps.get(source["configMap"]["name"])
            data = None if obj is None else _configmap_data(obj)
            rewrite = True
        elif "secret" in source:
            ref = source["secret"]
            name = ref.get("secretName") or ref.get("name")
            obj = self.secrets.get(name)
            data = None if obj is None else _secret_data(obj)
            rewrite = False  # certificates and keys are not text to rewrite
        else:
            return {}
        if data is None:
            if not ref.get("optional"):
                self.problems.append(f"{plan.key}: volume source {ref} is not rendered")
            return {}
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        files = {}
        for item in items:
            content = data.get(item["key"])
            if content is None:
                self.problems.append(f"{plan.key}: volume {ref} has no key {item['key']}")
                continue
            if rewrite:
                text = self._rewrite(plan, content.decode(), f"file {item['path']}", {})
                content = text.encode()
            files[item["path"]] = content
        return files

    def _plan(self, pod: Pod, container: dict[str, Any], init: bool) -> ContainerPlan:
        plan = ContainerPlan(pod=pod, container=container, init=init)
        plan.service = service_of(list(container.get("command") or []))
        plan.mounts = self._mounts(pod, container)
        raw_env = self._env(pod, container)
        argv = [expand(a, raw_env) for a in container.get("command") or []]
        args = [expand(a, raw_env) for a in container.get("args") or []]
        if not argv:
            self.problems.append(f"{plan.key}: no command (the image's entrypoint is unknown)")
        plan.argv = self._rewrite_argv(plan, argv, "command") + self._rewrite_argv(
            plan, args, "args"
        )
        plan.env = {k: self._rewrite(plan, v, f"env {k}", {}) for k, v in raw_env.items()}
        self._write_volume_files(plan)
        return plan

    def process_env(self, plan: ContainerPlan, overrides: bool = True) -> dict[str, str]:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RELAYRL_", "KUBERNETES_", "PYTEST_"))
        }
        base["PATH"] = f"{self.python_bin}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}"
        env = base | plan.env
        return env | plan.overrides if overrides else env

    # -- proving the listen ports ---------------------------------------------------------

    def prove_listen_ports(self, plan: ContainerPlan) -> None:
        """Show that the chart's own config, args and env make the container listen on the
        containerPorts it declares; then point it at the local ports."""
        declared = {
            p.get("name") or str(p["containerPort"]): int(p["containerPort"])
            for p in container_ports(plan.container)
        }
        if plan.service is None:
            self._prove_by_flags(plan, declared)
            return
        listeners = LISTENERS[plan.service]
        config = self._resolved_config(plan)
        if config is None:
            return
        for name, section in listeners.items():
            node = _dig(config, section)
            if node.get("enabled", True) is False:
                continue
            port, host = node.get("port"), str(node.get("host", ""))
            where = ".".join((*section, "port")) or "port"
            if name not in declared:
                self.problems.append(
                    f"{plan.key}: listens on {where}={port} but declares no containerPort "
                    f"named {name!r} (declared: {declared})"
                )
                continue
            if port != declared[name]:
                self.problems.append(
                    f"{plan.key}: {where} is {port} but containerPort {name!r} is "
                    f"{declared[name]}: probes and Services would miss it"
                )
            if host not in ALL_INTERFACES:
                self.problems.append(
                    f"{plan.key}: {'.'.join((*section, 'host')) or 'host'} is {host!r}: "
                    f"only reachable inside the container, not on the pod IP"
                )
            local = self.local_ports[(plan.pod.name, plan.name, declared[name])]
            prefix = f"RELAYRL_{plan.service.upper()}__" + "".join(
                f"{s.upper()}__" for s in section
            )
            plan.overrides[prefix + "PORT"] = str(local)
            plan.overrides[prefix + "HOST"] = LOOPBACK
        for name, number in declared.items():
            if name in listeners:
                continue
            if plan.service == "trainer" and name == RENDEZVOUS_PORT_NAME:
                self._prove_rendezvous(plan, number)
            else:
                self.problems.append(
                    f"{plan.key}: containerPort {name}={number} matches no listener of "
                    f"relayrl-{plan.service}"
                )
        if plan.service == "gateway":
            self._replace_discovery(plan, config)

    def _resolved_config(self, plan: ContainerPlan) -> dict[str, Any] | None:
        flag = "--print-command" if plan.service == "engine" else "--print-config"
        result = subprocess.run(
            [*plan.argv, flag],
            env=self.process_env(plan, overrides=False),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            self.problems.append(
                f"{plan.key}: `{shlex.join(plan.argv)} {flag}` with the chart's env exited "
                f"{result.returncode}: {result.stderr.strip()[-800:]}"
            )
            return None
        if plan.service != "engine":
            return yaml.safe_load(result.stdout)
        words = shlex.split(result.stdout.strip().splitlines()[-1])
        host = words[words.index("--host") + 1] if "--host" in words else "127.0.0.1"
        port = int(words[words.index("--port") + 1]) if "--port" in words else None
        return {"host": host, "port": port}

    def _prove_by_flags(self, plan: ContainerPlan, declared: Mapping[str, int]) -> None:
        for name, number in declared.items():
            if number not in plan.own_flags:
                self.problems.append(
                    f"{plan.key}: nothing in its command/args makes it listen on containerPort "
                    f"{name}={number}"
                )
        if declared and Path(plan.argv[0]).name == "redis-server":
            plan.argv += ["--bind", LOOPBACK]  # local run: loopback only

    def _prove_rendezvous(self, plan: ContainerPlan, number: int) -> None:
        if "WORLD_SIZE" not in plan.env:
            self.notes.append(
                f"{plan.key}: containerPort {RENDEZVOUS_PORT_NAME}={number} is unused by a "
                "single-rank trainer (it picks its own MASTER_PORT)"
            )
            return
        master_port = plan.env.get("MASTER_PORT")
        if master_port != str(number):
            self.problems.append(
                f"{plan.key}: MASTER_PORT={master_port} but containerPort "
                f"{RENDEZVOUS_PORT_NAME} is {number}"
            )
        plan.overrides["MASTER_PORT"] = str(self.local_ports[(plan.pod.name, plan.name, number)])

    def _replace_discovery(self, plan: ContainerPlan, config: Mapping[str, Any]) -> None:
        """EndpointSlice discovery needs an API server, which cannot run here: the gateway gets
        the URLs those EndpointSlices would list instead (after checking the Service, port
        name and RBAC the discovery relies on)."""
        engines = config.get("engines") or {}
        k8s = engines.get("kubernetes")
        if not k8s:
            return
        what = f"{plan.key} engines.kubernetes"
        if k8s.get("namespace") != plan.pod.namespace:
            self.problems.append(f"{what}: namespace {k8s.get('namespace')!r} is not the pod's")
        service = self.services.get(k8s["service"])
        urls = list(engines.get("urls") or [])
        if service is None:
            self.problems.append(f"{what}: no Service {k8s['service']!r} is rendered")
        else:
            ports = service["spec"].get("ports") or []
            port_name = k8s.get("port_name")
            sp = next((p for p in ports if port_name is None or p.get("name") == port_name), None)
            if sp is None:
                self.problems.append(f"{what}: Service {k8s['service']} has no port {port_name!r}")
            else:
                for pod in self._selected(service):
                    local = self._pod_port(pod, sp.get("targetPort", sp["port"]), what)
                    if local is not None:
                        urls.append(f"{k8s.get('scheme', 'http')}://{LOOPBACK}:{local}")
                        self._depend(plan, pod)
        self._check_discovery_rbac(plan, what)
        plan.overrides["RELAYRL_GATEWAY__ENGINES__KUBERNETES"] = "null"
        plan.overrides["RELAYRL_GATEWAY__ENGINES__URLS"] = json.dumps(list(dict.fromkeys(urls)))
        self.notes.append(f"{what}: replaced by the URLs its EndpointSlices would list: {urls}")

    def _check_discovery_rbac(self, plan: ContainerPlan, what: str) -> None:
        spec = plan.pod.spec
        account = spec.get("serviceAccountName", "default")
        if spec.get("automountServiceAccountToken") is False:
            self.problems.append(f"{what}: the pod mounts no service account token")
        for binding in self.rolebindings.values():
            if not any(
                s.get("kind") == "ServiceAccount" and s.get("name") == account
                for s in binding.get("subjects") or []
            ):
                continue
            role = self.roles.get(binding["roleRef"]["name"], {})
            for rule in role.get("rules") or []:
                if (
                    "discovery.k8s.io" in rule.get("apiGroups", [])
                    and "endpointslices" in rule.get("resources", [])
                    and {"list", "watch"} <= set(rule.get("verbs", []))
                ):
                    return
        self.problems.append(f"{what}: ServiceAccount {account} may not list+watch endpointslices")

    # -- running --------------------------------------------------------------------------

    def __enter__(self) -> ChartSmoke:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _spawn(self, plan: ContainerPlan) -> LocalProcess:
        process = LocalProcess(
            pod=plan.pod.name,
            container=plan.name,
            argv=plan.argv,
            env=self.process_env(plan),
            cwd=self.root,
            log_path=self.root / "logs" / f"{_short(plan.pod.name)}.{plan.name}.log",
        )
        with self._lock:
            self.processes.append(process)
        process.start()
        return process

    def run_to_completion(self, plan: ContainerPlan, timeout_s: float) -> tuple[int | None, str]:
        process = self._spawn(plan)
        assert process.process is not None
        try:
            code = process.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        process.stop(grace_s=5)
        return code, process.log_tail()

    def up(self) -> None:
        """Start the selected pods, each once every pod it addresses has passed its startup
        probe (init containers first, to completion). Problems go to `self.problems`."""
        ready = {p.name: threading.Event() for p in self.pods}
        failed = threading.Event()
        threads = [
            threading.Thread(target=self._bring_up, args=(p, ready, failed), daemon=True)
            for p in self.pods
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _bring_up(self, pod: Pod, ready: dict[str, threading.Event], failed: threading.Event):
        try:
            for container in pod.containers(init=True):
                plan = self.plans[f"{pod.name}/{container['name']}"]
                code, log = self.run_to_completion(plan, timeout_s=self.start_cap_s)
                if code != 0:
                    raise RuntimeError(f"init container {plan.key} exited {code}:\n{log}")
            plans = [self.plans[f"{pod.name}/{c['name']}"] for c in pod.containers()]
            for plan in plans:
                self.prove_listen_ports(plan)
            for dependency in sorted(self.depends[pod.name] & set(ready)):
                while not ready[dependency].wait(0.5):
                    if failed.is_set():
                        return
            with self._lock:
                self.start_order.append(pod.name)
            for plan in plans:
                self._spawn(plan)
            for plan in plans:
                kind = "startupProbe" if plan.container.get("startupProbe") else "readinessProbe"
                result = self.probe(plan, kind, cap_s=self.start_cap_s)
                if not result.ok:
                    raise RuntimeError(result.line())
            ready[pod.name].set()
        except Exception as exc:
            with self._lock:
                self.problems.append(f"{pod.name} did not start: {exc}")
            failed.set()

    def process_of(self, plan: ContainerPlan) -> LocalProcess | None:
        with self._lock:
            found = [
                p for p in self.processes if p.pod == plan.pod.name and p.container == plan.name
            ]
        return found[-1] if found else None

    def probe(self, plan: ContainerPlan, kind: str, cap_s: float | None = None) -> ProbeResult:
        """Run one of the container's probes as the kubelet would, retrying until it passes
        or its budget runs out; recorded in `probe_results`."""
        probe = plan.container[kind]
        period = float(probe.get("periodSeconds", 10))
        budget = probe.get("initialDelaySeconds", 0) + probe.get("failureThreshold", 3) * period
        cap = self.probe_cap_s if cap_s is None else cap_s
        budget = min(budget, cap)
        timeout_s = float(probe.get("timeoutSeconds", 1))
        check, handler = self._probe_check(plan, probe, timeout_s)
        process = self.process_of(plan)
        started = time.monotonic()
        attempts, ok, detail = 0, False, "not tried"
        while True:
            attempts += 1
            if process is not None and not process.alive():
                code = process.process.returncode if process.process else None
                ok, detail = False, f"process exited {code}:\n{process.log_tail(1500)}"
                break
            ok, detail = check()
            if ok or time.monotonic() - started >= budget:
                break
            time.sleep(min(period, 1.0))
        result = ProbeResult(
            plan.pod.name, plan.name, kind, handler, ok, attempts,
            time.monotonic() - started, detail,
        )  # fmt: skip
        with self._lock:
            self.probe_results.append(result)
        return result

    def _probe_check(self, plan: ContainerPlan, probe: Mapping[str, Any], timeout_s: float):
        found = probe_port(probe)
        if found is None:
            argv = self._rewrite_argv(plan, list(probe["exec"]["command"]), "exec probe")
            env = self.process_env(plan)

            def run_exec() -> tuple[bool, str]:
                try:
                    result = subprocess.run(
                        argv, env=env, cwd=self.root, capture_output=True, text=True,
                        timeout=timeout_s, check=False,
                    )  # fmt: skip
                except subprocess.TimeoutExpired:
                    return False, f"no exit within timeoutSeconds={timeout_s:g}"
                out = (result.stderr or result.stdout).strip()[-500:]
                return result.returncode == 0, f"exit {result.returncode} {out}".strip()

            return run_exec, f"exec {shlex.join(argv)}"
        handler, port = found
        number = find_container_port(plan.container, port)
        if number is None:
            return (lambda: (False, f"port {port!r} is not declared")), f"{handler} {port!r}"
        local = self.local_ports[(plan.pod.name, plan.name, number)]
        spec = probe[handler]
        if handler == "grpc":
            service = spec.get("service") or ""
            return (
                lambda: grpc_health_check(local, service, timeout_s),
                f"grpc :{number} -> {LOOPBACK}:{local} service={service!r}",
            )
        if handler == "httpGet":
            scheme = spec.get("scheme", "HTTP").lower()
            url = f"{scheme}://{LOOPBACK}:{local}{spec.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
            return (
                lambda: http_get_check(url, headers, timeout_s),
                f"httpGet {port}:{spec.get('path', '/')} -> {url}",
            )
        return (lambda: tcp_check(local, timeout_s)), f"tcpSocket :{number} -> {local}"

    def probe_all(self) -> list[ProbeResult]:
        """Every probe of every running container (startup, readiness, liveness)."""
        results = []
        for pod in self.pods:
            for container in pod.containers():
                plan = self.plans[f"{pod.name}/{container['name']}"]
                for kind in PROBE_KINDS:
                    if container.get(kind):
                        results.append(self.probe(plan, kind))
        return results

    def run_test_pods(self, timeout_s: float = 60.0) -> list[tuple[str, int | None, str]]:
        """The chart's `helm test` pods, each container run to completion: (key, code, log)."""
        results = []
        for pod in self.test_pods:
            for container in pod.containers(init=True) + pod.containers():
                plan = self.plans[f"{pod.name}/{container['name']}"]
                code, log = self.run_to_completion(plan, timeout_s)
                results.append((plan.key, code, log))
        return results

    def scrape_service_monitors(self) -> list[tuple[str, bool, str]]:
        """GET every endpoint of every ServiceMonitor as Prometheus would reach it: the
        selected Services' port of that name -> targetPort -> the pod's local port.
        (what, ok, detail); a scrape passes on HTTP 200 with Prometheus text."""
        results = []
        selected = {p.name for p in self.pods}
        for name, monitor in _named(self.objects, "ServiceMonitor").items():
            spec = monitor.get("spec", {})
            match = (spec.get("selector") or {}).get("matchLabels")
            services = [
                s
                for s in self.services.values()
                if _selects(match, s["metadata"].get("labels", {}))
            ]
            if not services:
                results.append((f"ServiceMonitor {name}", False, "selects no Service"))
            for service in services:
                for endpoint in spec.get("endpoints") or []:
                    what = f"ServiceMonitor {name} -> Service {service['metadata']['name']}"
                    port = next(
                        (p for p in service["spec"].get("ports") or []
                         if p.get("name") == endpoint.get("port")),
                        None,
                    )  # fmt: skip
                    if port is None:
                        results.append((what, False, f"no port named {endpoint.get('port')!r}"))
                        continue
                    for pod in self._selected(service):
                        if pod.name not in selected:
                            continue
                        local = self._pod_port(pod, port.get("targetPort", port["port"]), what)
                        if local is None:
                            results.append((what, False, "targetPort not declared"))
                            continue
                        scheme = endpoint.get("scheme", "http")
                        url = f"{scheme}://{LOOPBACK}:{local}{endpoint.get('path', '/metrics')}"
                        results.append((f"{what} {url}", *_scrape(url)))
        return results

    def down(self) -> list[tuple[str, int | None, float, bool]]:
        """Stop every process, newest pod first, each within its pod's grace period:
        (key, exit code, seconds, exited within grace)."""
        stopped = []
        with self._lock:
            processes = list(reversed(self.processes))
            self.processes = []
        for process in processes:
            pod = next((p for p in self.all_pods + self.test_pods if p.name == process.pod), None)
            grace = float((pod.spec if pod else {}).get("terminationGracePeriodSeconds", 30))
            code, seconds, in_grace = process.stop(grace_s=grace)
            stopped.append((f"{process.pod}/{process.container}", code, seconds, in_grace))
        return stopped


# -- small helpers -----------------------------------------------------------------------------


def _scrape(url: str) -> tuple[bool, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as response:
            body = response.read().decode(errors="replace")
            code = response.status
    except (urllib.error.URLError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))
    ok = code == 200 and "# TYPE " in body
    return ok, f"HTTP {code}, {body.count(chr(10))} lines"


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`,
    anything else stays as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def service_of(argv: list[str]) -> str | None:
    """Which relayrl program a container command starts (None: something else)."""
    if not argv:
        return None
    base = Path(argv[0]).name
    if base.startswith("relayrl-") and base[len("relayrl-") :] in LISTENERS:
        return base[len("relayrl-") :]
    if base.startswith("python") and argv[1:3] == ["-m", "relayrl.engine"]:
        return "engine"
    if base == "relayrl" and argv[1:2] == ["engine"]:
        return "engine"
    return None


def _dig(config: Mapping[str, Any], section: tuple[str, ...]) -> Mapping[str, Any]:
    node: Any = config
    for key in section:
        node = (node or {}).get(key) or {}
    return node


def _short(name: str) -> str:
    """Short folder names: vLLM's ipc sockets live below the engine's cache folder and a Unix
    socket path has at most 107 bytes."""
    return name.split("-relayrl-", 1)[-1]


_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20}
_SUFFIXES |= {"Gi": 2**30, "Ti": 2**40}


def _quantity(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text.strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return float(m.group(1)) * _SUFFIXES.get(m.group(2), 1)
