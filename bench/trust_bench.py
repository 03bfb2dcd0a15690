"""Trust in a running system: a real `relayrl up` (redis, reward, weight-sync, vLLM engine,
gateway, trainer, with its per-run tokens) is knocked on and fuzzed while it trains.

1. Knocks (relayrl_testkit.helpers.trust): every gRPC method of the four services called with
   no credentials, with an unknown token, and with the token of every run principal whose role
   the method's access table does not list; then every HTTP route of the gateway's agent
   endpoint and the engine's control routes without credentials. Each call a surface accepts
   is counted (`unauth_accepted`, `wrong_role_accepted`) and listed.
2. Fuzz (relayrl_testkit.helpers.fuzz): at least `--cases` requests per service generated from
   the proto descriptors, sent with the token of a role allowed to call the method (so they
   reach the handlers), and the same per agent HTTP route.
   A crash is UNKNOWN, INTERNAL or UNAVAILABLE (HTTP: a 500 or a dropped connection);
   afterwards every service must still answer its health check with the same PID (none was
   restarted).
3. The reward pod's code sandbox (relayrl-sandbox, started as the chart runs it): code
   submitted by uids it does not allow (past the socket's file mode: the peer check alone must
   refuse), then `--cases` bad requests on its socket; a crash is an answer outside the
   protocol or a dropped connection, and it must still answer a ping afterwards.

The last line is exactly:
    trust-bench: fuzz_cases=<n> crashes=<n> unauth_accepted=<n> wrong_role_accepted=<n>
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from chaos_bench import UpRun

from relayrl.core.access import ACCESS
from relayrl.core.interceptors import ANY_PRINCIPAL
from relayrl.gateway.config import AgentHttpConfig
from relayrl.proto.trainer.v1 import trainer_pb2
from relayrl.reward.sandbox_service import MAX_REQUEST_BYTES
from relayrl.up.secrets import PRINCIPALS, token_path
from relayrl_testkit.helpers.fuzz import (
    AGENT_ROUTES,
    Case,
    FuzzReport,
    decodes_as,
    fuzz_http,
    fuzz_sandbox,
    fuzz_service,
)
from relayrl_testkit.helpers.sandbox import start_sandbox
from relayrl_testkit.helpers.trust import knock_on_run, knock_on_sandbox, service_descriptors

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_accepts(url: str, method: str, headers: dict[str, str] | None = None) -> bool:
    """Whether an HTTP route answered a call without credentials with anything but 401/403."""
    body = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with NO_PROXY.open(request, timeout=30) as response:
            response.read()
            return True
    except urllib.error.HTTPError as exc:
        return exc.code not in (401, 403)
    except (urllib.error.URLError, OSError):
        return False


def stops_the_trainer(method: Any, case: Case) -> bool:
    """Control(STOP) is the trainer doing its job when told to end, not bad input surviving."""
    if method.name != "Control":
        return False
    request = decodes_as(method, case)
    return request is not None and request.action == trainer_pb2.CONTROL_ACTION_STOP


def healthy(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="Fuzz cases per service.")
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="trust-bench-"))
    run = UpRun(workdir / "runs", steps=400, log=workdir / "up.log")
    started = time.monotonic()
    try:
        run.wait(lambda: run.steps_logged() >= 1, "the first trainer step", 900)
        children = run.children()
        pids = {name: child["pid"] for name, child in children.items()}
        tokens = {p: token_path(run.run_dir, p).read_text().strip() for p in PRINCIPALS}

        # -- knocks --------------------------------------------------------------------------
        knocks = knock_on_run(run.run_dir)
        unauth = [
            f"{k.service}.{k.method} ({k.caller}): {k.status}" for k in knocks.unauth_accepted
        ]
        wrong = [
            f"{k.service}.{k.method} ({k.caller}): {k.status}" for k in knocks.wrong_role_accepted
        ]
        agent_url = agent_base(run)
        http_tried = []
        for method, route in AGENT_ROUTES:
            url = agent_url + route.replace("{id}", "trust-bench-1")
            http_tried.append(f"gateway-http {method} {route}")
            if http_accepts(url, method):
                unauth.append(f"gateway-http {method} {route} (anonymous)")

        # -- fuzz ----------------------------------------------------------------------------
        reports: list[FuzzReport] = []
        for service in ("reward", "weightsync", "gateway", "trainer"):
            methods = list(service_descriptors()[service].methods)
            # 5 % more: cases skipped (a trainer told to stop) still leave --cases per service
            per_method = math.ceil(args.cases * 1.05 / len(methods))

            def credentials(method: Any, service: str = service) -> list[tuple[str, str]]:
                allowed = ACCESS[service].methods[method.name]
                principal = next(
                    (p for p in PRINCIPALS if p in allowed or ANY_PRINCIPAL in allowed), None
                )
                return (
                    [] if principal is None else [("authorization", f"Bearer {tokens[principal]}")]
                )

            reports.append(
                fuzz_service(
                    children[service]["target"],
                    methods,
                    per_method=per_method,
                    seed=args.seed,
                    metadata_for=credentials,
                    skip=stops_the_trainer,
                    timeout_s=2.0,
                    service=service,
                )
            )
        limit = AgentHttpConfig.model_fields["max_request_bytes"].default
        reports.append(
            fuzz_http(  # as an agent: most cases name sessions it did not open (403, 404)
                agent_url,
                per_route=math.ceil(args.cases / len(AGENT_ROUTES)),
                seed=args.seed,
                max_request_bytes=limit,
                headers={"Authorization": f"Bearer {tokens['agent']}"},
            )
        )

        # -- the reward pod's sandbox container (relayrl-sandbox), as the chart runs it ------
        sandbox_report, sandbox_knocks, sandbox_down = sandbox_surface(workdir, args)
        reports.append(sandbox_report)
        unauth += [f"sandbox {k.method}: {k.status}" for k in sandbox_knocks.unauth_accepted]

        # -- afterwards ----------------------------------------------------------------------
        after = run.children()
        down = [
            name
            for name in ("reward", "weightsync", "gateway", "trainer")
            if after[name]["pid"] != pids[name] or not healthy(after[name]["target"])
        ] + sandbox_down
    finally:
        run.stop()

    print(f"relayrl up on {run.run_dir} ({time.monotonic() - started:.0f} s)")
    print("\nknocks (calls that must be refused):")
    print(f"  gRPC methods and engine routes tried: {len(knocks.methods_tried())} "
          f"({', '.join(knocks.methods_tried())})")  # fmt: skip
    print(f"  HTTP routes tried without credentials: {len(http_tried)} ({', '.join(http_tried)})")
    print(f"  calls: {len(knocks.of_kind(anonymous=True))} without valid credentials, "
          f"{len(knocks.of_kind(anonymous=False))} with another role's token")  # fmt: skip
    print(f"  sandbox socket: code submitted as {len(sandbox_knocks.knocks)} uids it does not "
          f"allow ({', '.join(k.method for k in sandbox_knocks.knocks)})")  # fmt: skip
    for line in unauth:
        print(f"  ACCEPTED without credentials: {line}")
    for line in wrong:
        print(f"  ACCEPTED with the wrong role: {line}")
    print(f"\n{'surface':<14}{'cases':>7}{'crashes':>9}  statuses")
    for report in reports:
        statuses = ", ".join(f"{k}={v}" for k, v in sorted(report.statuses.items()))
        print(f"{report.service:<14}{report.cases:>7}{len(report.crashes):>9}  {statuses}")
        for crash in report.crashes[:10]:
            print(f"    {crash}")
    for name in down:
        print(f"NOT HEALTHY after the fuzz (or restarted): {name}")
    crashes = sum(len(r.crashes) for r in reports) + len(down)
    cases = sum(r.cases for r in reports)
    print(
        f"trust-bench: fuzz_cases={cases} crashes={crashes} "
        f"unauth_accepted={len(unauth)} wrong_role_accepted={len(wrong)}"
    )
    return 0


def sandbox_surface(workdir: Path, args: argparse.Namespace) -> tuple[FuzzReport, Any, list[str]]:
    """relayrl-sandbox as the chart runs it (root with only the sandbox's capabilities): code
    submitted by uids it does not allow (knocks), then --cases fuzz cases from the uid it does
    (this process), then a ping. Returns the fuzz report, the knocks and what is down."""
    # a folder other uids can reach (the run's workdir is private)
    sockets = Path(tempfile.mkdtemp(prefix="trust-bench-sandbox-"))
    sockets.chmod(0o755)
    socket_path = sockets / "sandbox.sock"
    sandbox = start_sandbox(workdir / "sandbox", socket_path, allow_uids=[0])
    try:
        socket_path.chmod(0o666)  # past the file mode: the peer check alone must refuse
        knocks = knock_on_sandbox(socket_path, [10001, 60005])
        report = fuzz_sandbox(
            str(socket_path), cases=args.cases, seed=args.seed, max_request_bytes=MAX_REQUEST_BYTES
        )
        probe = [sys.executable, "-m", "relayrl.core.healthcheck", "sandbox", str(socket_path)]
        alive = sandbox.alive() and subprocess.run(probe, capture_output=True).returncode == 0
    finally:
        sandbox.stop()
        shutil.rmtree(sockets, ignore_errors=True)
    return report, knocks, [] if alive else ["sandbox"]


def agent_base(run: UpRun) -> str:
    """The agent endpoint's base URL, from the gateway's config in the run folder."""
    import yaml

    for path in (run.run_dir / "services" / "gateway").glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        if isinstance(config, dict) and "agent_http" in config:
            return f"http://127.0.0.1:{config['agent_http']['port']}"
    raise RuntimeError("the gateway's config in the run folder names no agent_http port")


if __name__ == "__main__":
    sys.exit(main())
