"""`relayrl status [RUN_DIR]`: the state of a run's stack, asked of the stack itself.

    run r-20261129-201500 (arith, separate_async, eta 1): training, started 4m12s ago
    services: redis ok (pid 1234) · reward SERVING · gateway SERVING · weightsync SERVING
              · trainer SERVING (step 23/60) · engine-0 ok
    weights:  committed v23; engine-0 v23
    queue:    groups pending=3 running=5 scored=2 consumed=184 | trajectories ...

Every line comes from a live call (gRPC health, Trainer.GetStatus, WeightSync.GetVersion,
the TransferQueue's counts); what does not answer says so instead of failing the command.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

from relayrl.up.run_state import ENDED, RUN_FILE, RunState
from relayrl.up.stack_state import StackState

HEALTH_TIMEOUT_S = 2.0


def latest_run(runs_dir: Path) -> Path | None:
    runs = [p for p in runs_dir.glob("r-*") if RunState.exists(p)]
    return max(runs, key=lambda p: (p / RUN_FILE).stat().st_mtime, default=None)


def _health(target: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return f"down ({exc.code().name})"


def _http_ok(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + "/health", timeout=HEALTH_TIMEOUT_S) as response:
            return "ok" if response.status == 200 else f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"down ({getattr(exc, 'reason', exc)})"


def _trainer_status(target: str, run_dir: Path) -> str:
    import grpc

    from relayrl.core.grpc_client import sync_channel
    from relayrl.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
    from relayrl.up.secrets import operator_identity

    try:
        with sync_channel(target, operator_identity(run_dir), []) as channel:
            reply = trainer_pb2_grpc.TrainerStub(channel).GetStatus(
                trainer_pb2.GetStatusRequest(), timeout=HEALTH_TIMEOUT_S
            )
    except grpc.RpcError:
        return ""
    return f"step {reply.step}/{reply.total_steps}, published v{reply.published_version.version}"


def status_lines(run_dir: Path) -> list[str]:
    from relayrl.up.progress import replica_versions
    from relayrl.up.secrets import with_redis_password

    run = RunState.read(run_dir)
    lines = [
        f"run {run.run_id} ({run.task}, {run.mode}, eta {run.eta}, {run.steps} steps): "
        f"{run.state}, started {_ago(run.started)} ago"
    ]
    stack = StackState.read_if_any(run_dir)
    if stack is None or run.state in ENDED:
        lines.append(f"stack: not running ({run.state})")
        lines += _eval_lines(run_dir)
        return lines
    redis_url = with_redis_password(stack.redis_url, run_dir)
    health = []
    for name, child in stack.children.items():
        restarts = f", {child.restarts} restarts" if child.restarts else ""
        if name == "redis":
            state = _redis_ok(redis_url)
        elif child.url is not None:  # an engine
            state = _http_ok(child.url)
        else:
            state = _health(str(child.target))
            if name == "trainer":
                extra = _trainer_status(str(child.target), run_dir)
                state += f" ({extra})" if extra else ""
        health.append(f"{name} {state} (pid {child.pid}{restarts})")
    lines.append("services: " + "; ".join(health))
    ws = stack.children.get("weightsync")
    versions = replica_versions(str(ws.target), run_dir) if ws else None
    if versions is None:
        lines.append("weights:  weight-sync does not answer")
    else:
        lines.append(
            "weights:  "
            + "; ".join(
                f"{rid} v{v}{'' if live else ' (out of routing)'}"
                for rid, (v, live) in versions.items()
            )
        )
    lines += _queue_lines(stack, redis_url)
    lines += _eval_lines(run_dir)
    return lines


def _redis_ok(url: str) -> str:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=HEALTH_TIMEOUT_S)
        client.ping()
        client.close()
        return "ok"
    except redis.RedisError as exc:
        return f"down ({exc})"


def _queue_lines(stack: StackState, redis_url: str) -> list[str]:
    import redis

    from relayrl.tq import TQConfig, TransferQueue

    try:
        tq = TransferQueue.from_config(
            TQConfig(
                url=redis_url,
                namespace=stack.namespace,
                partitions=[],
                socket_timeout_s=HEALTH_TIMEOUT_S,
                connect_timeout_s=HEALTH_TIMEOUT_S,
            )
        )
        counts = tq.counts(stack.partition)
        tq.close()
    except (redis.RedisError, Exception) as exc:
        return [f"queue:    unavailable ({exc})"]
    groups = " ".join(f"{s.value}={n}" for s, n in counts.groups.items())
    trajectories = " ".join(f"{s.value}={n}" for s, n in counts.trajectories.items())
    return [f"queue:    groups {groups}", f"          trajectories {trajectories}"]


def _eval_lines(run_dir: Path) -> list[str]:
    from relayrl.core.records import EvalRecord, read_records

    records = read_records(run_dir / "eval.jsonl", EvalRecord)
    if not records:
        return []
    text = ", ".join(
        f"FAILED@{r.step}" if r.accuracy is None else f"{r.accuracy:.1%}@{r.step}"
        for r in records[-6:]
    )
    return [f"held-out: {text} (greedy accuracy at trainer step)"]


def _ago(started: float) -> str:
    seconds = int(time.time() - started)
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
