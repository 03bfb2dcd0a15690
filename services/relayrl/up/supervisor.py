"""The local stack: a private redis-server, the four services and one vLLM engine as child
processes, wired together on fixed loopback ports and supervised.

Ports are chosen once per `relayrl up` and kept across restarts, so a restarted gateway is
found where the trainer and weight-sync already look for it. Every child leads its own process
group (a Ctrl-C in the terminal reaches only `relayrl up`, which stops them in order) and is
stopped by PID.

Supervision: a child that exits when nobody asked it to is started again after a backoff
(doubling), up to `supervision.max_restarts` times. What a restart means per child:
- reward-service, gateway: stateless; the TransferQueue holds their work (unacknowledged
  events are redelivered, claims expire after their lease and are claimed again);
- trainer: resumes from its last checkpoint; the groups consumed after it go back to scored;
- engine: loads the warm start from disk; the gateway sees it healthy again and registers
  it with weight-sync, which loads the committed version into it before the gateway routes
  to it again (docs/recovery.md);
- weight-sync: reads the committed version back from its state_dir; the gateway registers
  the replicas with it again within seconds;
- redis-server: replays its AOF.
The trainer's exit 0 means the run is complete; it is not restarted.

With `hosts.isolate` each child runs on a host of its own (relayrl.up.hosts): the network is
made when the children are built and removed when they are stopped, and a child is spawned,
and restarted, from inside its namespace, as it is from inside its CPU set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relayrl.core.atomic import atomic_write_bytes
from relayrl.core.service_process import ServiceProcess
from relayrl.core.supervised import Supervised
from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.stack import SERVICES, StackConfig
from relayrl.stack.local import AGENTS, PARTS, LocalPorts
from relayrl.tq.server import RedisServer
from relayrl.trainer.progress import EXIT_NO_PROGRESS
from relayrl.up.config import UpConfig
from relayrl.up.hosts import HostNetwork
from relayrl.up.prepare import RunFiles
from relayrl.up.secrets import (
    REDIS_PASSWORD_ENV,
    ensure_run_secrets,
    operator_identity,
    redis_password,
    run_identities,
)
from relayrl.up.stack_state import ChildState, StackState
from relayrl.up.wiring import NAMESPACE, PARTITION, up_stack

logger = logging.getLogger(__name__)

# Start order; stop order is the reverse (the trainer first, Redis last). Weight-sync comes up
# before the gateway, which registers its replicas with weight-sync as it starts: the other way
# round the first registration fails and waits out the gateway's retry interval.
ORDER = ("redis", "reward", "engine-0", "weightsync", "gateway", "trainer")


class ChildStartError(Exception):
    """A child that did not come up: what the user reads is one line naming the child, why,
    and its log (the log holds the details)."""

    def __init__(self, child: str, reason: str, log_path: Path) -> None:
        super().__init__(f"{child} failed to start ({reason}); see {log_path}")
        self.child, self.reason, self.log_path = child, reason, log_path


def last_log_message(path: Path, max_chars: int = 300) -> str:
    """The last line of a child's log as a person would quote it: the `message` of a JSON log
    record, else the line itself; "" when the log is empty or unreadable."""
    try:
        with path.open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 16384))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if not line:
            continue
        with contextlib.suppress(ValueError, AttributeError):
            line = str(json.loads(line).get("message", line))
        return line[:max_chars]
    return ""


def start_failure_reason(exc: BaseException) -> str:
    """`exc` from a child's start() in a few words (its first line: the rest is the log)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first.rstrip(":")


@dataclass(frozen=True)
class ChildSpec:
    """How the supervisor treats one child, beyond what its process class does (the
    `Supervised` it is): given when the stack builds it."""

    stop_timeout_s: float = 20.0
    """How long its graceful stop may take before SIGKILL."""
    max_start_timeout_s: float | None = None
    """A cap on `supervision.start_timeout_s` for it."""
    done_exit_codes: frozenset[int] = frozenset()
    """Exit codes that end it for good: it is not restarted, and the run loop notices."""
    routes_to_engines: bool = False
    """The engines booting are waited for before it starts, and it is started once it routes
    to every one of them (weight-sync confirmed their weights): the gateway."""
    shown: Mapping[str, str] = field(default_factory=dict)
    """Where it serves, as stack.json shows it beside its pid and restarts."""

    def start_timeout(self, timeout_s: float) -> float:
        cap = self.max_start_timeout_s
        return timeout_s if cap is None else min(timeout_s, cap)


REDIS = ChildSpec(stop_timeout_s=10.0, max_start_timeout_s=120.0)
ENGINE = ChildSpec()
SERVICE = ChildSpec()
SERVICE_SPECS = {
    # The trainer finishes its step and checkpoints on SIGTERM: it gets the time. Its exit 0
    # means the run is complete, EXIT_NO_PROGRESS that a stop rule fired.
    "trainer": ChildSpec(stop_timeout_s=120.0, done_exit_codes=frozenset({0, EXIT_NO_PROGRESS})),
    "gateway": ChildSpec(routes_to_engines=True),
}


@dataclass
class Event:
    time: float
    child: str
    kind: str  # started, exited, restarted, gave_up, stopped
    detail: str = ""


@dataclass
class Supervisor:
    """The children of one run, their configs and their supervision."""

    config: UpConfig
    run_dir: Path
    model_dir: Path
    files: RunFiles
    ports: LocalPorts = field(default_factory=LocalPorts.choose)
    network: HostNetwork | None = None
    """The children's hosts (`hosts.isolate`); planned here when the config asks for them and
    none is given, made by `build()`, removed by `stop()`."""
    children: dict[str, Supervised] = field(default_factory=dict)
    specs: dict[str, ChildSpec] = field(default_factory=dict)
    restarts: Counter[str] = field(default_factory=Counter)
    events: list[Event] = field(default_factory=list)
    on_event: Callable[[Event], None] = lambda event: None
    failure: str = ""
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if self.network is None and self.config.hosts.isolate:
            self.network = HostNetwork.plan(PARTS)
        if self.network is not None:
            self.ports = self.ports.at(self.network.addresses())

    @property
    def redis_url(self) -> str:
        return self.ports.redis_url

    def target(self, service: str) -> str:
        return self.ports.target(service)

    def metrics_url(self, service: str) -> str:
        return self.ports.metrics_url(service)

    @property
    def engine_url(self) -> str:
        return self.ports.engine_url

    # -- configs ----------------------------------------------------------------------------

    def stack_config(self) -> StackConfig:
        """The four services' configs (relayrl.up.wiring); StackError names a bad field."""
        launcher = self.network.exec_prefix(AGENTS) if self.network is not None else []
        return up_stack(
            self.config, self.run_dir, self.model_dir, self.files.prompts, self.ports, launcher
        )

    def service_configs(self) -> dict[str, dict[str, Any]]:
        """What each service process is given as its config file."""
        stack = self.stack_config()
        return {name: stack.service_file(name) for name in SERVICES}

    def _env(self, service: str) -> dict[str, str]:
        """The run's Redis password; and the reward-service imports a user's reward function
        from where `relayrl up` was started, as `relayrl up` itself did when it checked it."""
        env = {}
        if (password := redis_password(self.run_dir)) is not None:
            env[REDIS_PASSWORD_ENV] = password
        if service == "reward" and self.config.reward.function is not None:
            paths = [str(Path.cwd()), *filter(None, [os.environ.get("PYTHONPATH")])]
            env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def engine_config(self) -> EngineConfig:
        e = self.config.engine
        return EngineConfig(
            model=self.model_dir,
            host=self.ports.address("engine-0"),
            port=self.ports.engine,
            max_model_len=e.max_model_len,
            max_num_seqs=e.max_num_seqs,
            cpu_kv_cache_space_gib=e.kv_cache_gib,
            seed=self.config.train.seed,
            cache_dir=self.config.runs_dir / "cache" / "vllm",
            callers_file=run_identities(self.run_dir).tokens_file
            if self.config.security.authenticate
            else None,
        )

    # -- lifecycle --------------------------------------------------------------------------

    def build(self) -> None:
        d = self.run_dir
        logs = d / "logs"
        if self.config.security.authenticate:
            ensure_run_secrets(d)
        if self.network is not None:
            self.network.create()
        redis = RedisServer(
            d / "redis",
            port=self.ports.redis,
            host=self.ports.address("redis"),
            password=redis_password(d),
        )
        self._add("redis", redis, replace(REDIS, shown={"url": redis.url}))
        configs = self.service_configs()
        for name in SERVICES:
            config = configs[name]
            service = ServiceProcess(
                f"relayrl-{name}", config, d / "services" / name,
                log_path=logs / f"{name}.log", env=self._env(name),
            )  # fmt: skip
            grpc, metrics = config["grpc"], config["metrics"]
            shown = {
                "target": f"{grpc['host']}:{grpc['port']}",
                "metrics": f"http://{metrics['host']}:{metrics['port']}/metrics",
            }
            self._add(name, service, replace(SERVICE_SPECS.get(name, SERVICE), shown=shown))
        engine = EngineProcess(
            self.engine_config(), d / "services" / "engine-0", log_path=logs / "engine-0.log"
        )
        self._add("engine-0", engine, replace(ENGINE, shown={"url": engine.url}))

    def _add(self, name: str, child: Supervised, spec: ChildSpec) -> None:
        self.children[name], self.specs[name] = child, spec

    def engines(self) -> dict[str, EngineProcess]:
        return {n: c for n, c in self.children.items() if isinstance(c, EngineProcess)}

    def describe(self, name: str) -> ChildState:
        """`name` as stack.json shows it."""
        host = self.network.host(name) if self.network is not None else None
        return ChildState(
            pid=self.children[name].pid,
            restarts=self.restarts[name],
            netns=None if host is None else host.netns,
            **self.specs[name].shown,
        )

    def start(self, names: tuple[str, ...] = ORDER, say: Callable[[str], None] = print) -> None:
        """Starts `names` in order, each ready before the next, and writes stack.json; a child
        that does not come up raises ChildStartError. Engines, the slowest to start, are the
        exception: one is spawned at its turn and waited for just before the gateway (which
        routes to it), so the services in between start while it boots."""
        if not self.children:
            self.build()
        timeout_s = self.config.supervision.start_timeout_s
        booting: dict[str, float] = {}  # engine -> when it was spawned
        for name in names:
            child, spec = self.children[name], self.specs[name]
            if isinstance(child, EngineProcess):
                with self._starting(name), self._placed(name):
                    child.spawn()
                booting[name] = time.monotonic()
                continue
            if spec.routes_to_engines:
                self._wait_for_engines(booting, timeout_s, say)
            started = time.monotonic()
            with self._starting(name), self._placed(name):
                child.start(timeout_s=spec.start_timeout(timeout_s))
            self._started(name, started, say)
            if spec.routes_to_engines:  # the engines serve once weight-sync vouches for them
                self.wait_for_routing(timeout_s)
        self._wait_for_engines(booting, timeout_s, say)
        self.write_state()

    def _wait_for_engines(
        self, booting: dict[str, float], timeout_s: float, say: Callable[[str], None]
    ) -> None:
        while booting:
            name, spawned = booting.popitem()
            child = self.children[name]
            assert isinstance(child, EngineProcess)
            with self._starting(name):
                child.wait_ready(timeout_s=max(1.0, timeout_s - (time.monotonic() - spawned)))
            self._started(name, spawned, say)

    @contextlib.contextmanager
    def _placed(self, name: str) -> Iterator[None]:
        """While `name` is spawned, this thread is where the child is to run: on its CPU set,
        and on its host (a network namespace is also a thread's, inherited by what it
        spawns); the thread is put back after."""
        with self._pinned(name), self._on_host(name):
            yield

    @contextlib.contextmanager
    def _on_host(self, name: str) -> Iterator[None]:
        if self.network is None:
            yield
            return
        with self.network.entered(name):
            yield

    @contextlib.contextmanager
    def _pinned(self, name: str) -> Iterator[None]:
        """While `name` is spawned, this thread runs on the child's CPU set
        (`placement`), so the child inherits it; the thread's own set is put back after."""
        cpus = self.config.placement.cpus_for(name)
        if cpus is None:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    @contextlib.contextmanager
    def _starting(self, name: str) -> Iterator[None]:
        """Turns a failure to start `name` into ChildStartError (naming its log's last
        message); what did start is in stack.json, to be stopped by PID."""
        try:
            yield
        except Exception as exc:
            self.write_state()
            log_path = self.children[name].log_path
            reason = start_failure_reason(exc)
            detail = last_log_message(log_path)
            if detail and detail not in reason:
                reason = f"{reason}: {detail}"
            raise ChildStartError(name, reason, log_path) from exc

    def _started(self, name: str, since: float, say: Callable[[str], None]) -> None:
        child = self.children[name]
        self._record(Event(time.time(), name, "started", f"pid {child.pid}"))
        say(f"  {name:<11} ready in {time.monotonic() - since:5.1f} s (pid {child.pid})")

    def wait_for_routing(self, timeout_s: float) -> None:
        """Until the gateway routes to every engine (weight-sync confirmed its weights);
        ChildStartError naming the engine otherwise."""
        import grpc

        from relayrl.core.grpc_client import sync_channel
        from relayrl.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc

        engines = list(self.engines())
        deadline = time.monotonic() + timeout_s
        states: dict[str, int] = {}
        with sync_channel(self.target("gateway"), operator_identity(self.run_dir), []) as channel:
            stub = rollout_pb2_grpc.RolloutGatewayStub(channel)
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.ListReplicas(rollout_pb2.ListReplicasRequest(), timeout=5)
                    states = {r.replica_id: r.state for r in reply.replicas}
                if all(states.get(n) == rollout_pb2.REPLICA_STATE_SERVING for n in engines):
                    return
                time.sleep(0.2)
        waiting = [n for n in engines if states.get(n) != rollout_pb2.REPLICA_STATE_SERVING]
        named = {n: rollout_pb2.ReplicaState.Name(states.get(n, 0)) for n in waiting}
        raise ChildStartError(
            waiting[0],
            f"not routed to {timeout_s:.0f} s after weight-sync started ({named})",
            self.children["weightsync"].log_path,
        )

    def write_state(self) -> None:
        StackState(
            redis_url=self.redis_url,
            namespace=NAMESPACE,
            partition=PARTITION,
            engines=[self.engine_url],
            children={name: self.describe(name) for name in self.children},
            written=time.time(),
            hosts=None if self.network is None else self.network.state(),
        ).write(self.run_dir)

    def _record(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)
        with (self.run_dir / "logs" / "supervisor.jsonl").open("a") as log:
            log.write(json.dumps(event.__dict__) + "\n")
        self.on_event(event)

    def supervise(self) -> None:
        """Watch the children in a background thread until `stop()`."""
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        backoff: dict[str, float] = {}
        while not self._stopping.wait(0.5):
            for name in ORDER:
                child = self.children.get(name)
                if child is None or child.pid is None or child.alive():
                    continue
                code, spec = child.exit_code(), self.specs[name]
                if code in spec.done_exit_codes:
                    continue  # finished, or a stop rule fired: the run loop notices
                if self._stopping.is_set():
                    return
                self._record(Event(time.time(), name, "exited", f"code {code}"))
                if self.restarts[name] >= self.config.supervision.max_restarts:
                    self.failure = (
                        f"{name} exited (code {code}) {self.restarts[name] + 1} times; giving up "
                        f"(see {self.run_dir / 'logs' / (name + '.log')})"
                    )
                    self._record(Event(time.time(), name, "gave_up", self.failure))
                    self._stopping.set()
                    return
                delay = backoff.get(name, self.config.supervision.restart_backoff_s)
                backoff[name] = min(delay * 2, 30.0)
                if self._stopping.wait(delay):
                    return
                self.restarts[name] += 1
                try:
                    with self._placed(name):
                        child.start(
                            timeout_s=spec.start_timeout(self.config.supervision.start_timeout_s)
                        )
                except Exception as exc:  # it counts as another exit on the next round
                    self._record(Event(time.time(), name, "restart_failed", str(exc)[:500]))
                    continue
                self._record(Event(time.time(), name, "restarted", f"pid {child.pid}"))
                self.write_state()

    @property
    def failed(self) -> bool:
        return bool(self.failure)

    def stop(self, say: Callable[[str], None] = print) -> None:
        """Stops every child, the trainer first (it checkpoints) and Redis last (its AOF
        is flushed on SIGTERM), then removes the children's hosts; idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for name in reversed(ORDER):
            child = self.children.get(name)
            if child is None or child.pid is None:
                continue
            with contextlib.suppress(Exception):
                was_alive = child.alive()
                child.stop(timeout_s=self.specs[name].stop_timeout_s)
                if was_alive:
                    self._record(Event(time.time(), name, "stopped"))
        self.write_state()
        if self.network is not None:
            self.network.remove()

    def snapshot_metrics(
        self, out_dir: Path, names: tuple[str, ...] | None = None
    ) -> dict[str, str]:
        """Each live service's and engine's /metrics as it stands (or only `names`'), saved to
        `<out_dir>/<name>.prom`: what a Prometheus scrape sees. Problems by name."""
        import urllib.error
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        urls = {name: self.metrics_url(name) for name in SERVICES}
        urls |= {name: f"{engine.url}/metrics" for name, engine in self.engines().items()}
        if names is not None:
            urls = {name: url for name, url in urls.items() if name in names}
        out_dir.mkdir(parents=True, exist_ok=True)
        problems = {}
        for name, url in urls.items():
            child = self.children.get(name)
            if child is None or not child.alive():
                continue
            try:
                with opener.open(url, timeout=10) as response:
                    body = response.read()
                atomic_write_bytes(out_dir / f"{name}.prom", body)
            except (urllib.error.URLError, OSError) as exc:
                problems[name] = str(exc)
        return problems
