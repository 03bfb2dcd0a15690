"""Rule-based scoring under a fixed offered load: the reward-service over gRPC (ScoreStream
from a separate client process) next to the same pipeline called in-process.

Both sides score the same items (manager `naive`, data_source gsm8k, responses ending in
`#### <n>` against a ground truth, 3 of 4 correct) with the same config and the same schedule:
open-loop, item k is due at start + k / rate and is sent then whether or not earlier results are
back (a sender that falls behind sends the overdue items at once). Latency is from the item's due
time to its result, so a client that cannot keep up is charged for it too.

    grpc        relayrl-reward as a child process; a second child process (this script with
                --client) runs a grpc.aio client: one ScoreStream, a writer on the schedule and
                a reader taking results as they come
    inprocess   RewardApp(config) in this process: pipeline.submit([item]) on the schedule, the
                result future's callback taking the time (what a trainer embedding the
                pipeline would do; no gRPC, no protobuf, no second process)

Each (rate, side) runs `--warmup` seconds unmeasured, then `--duration` seconds measured;
achieved = measured results / (last result - first measured due time). The sides alternate
which goes first per rate. `--rate` is a load this 2-core machine sustains on both sides;
`--over-rate` (0: skip) shows one it does not.

The last line is exactly:
    reward-load-bench: grpc=<N>/s p50=<ms> p99=<ms> inprocess=<M>/s p50=<ms> p99=<ms>
    latency_ratio_p50=<grpc p50 / inprocess p50>
(all on one line, at `--rate`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANAGER = "naive"


def config_dict() -> dict[str, Any]:
    return {
        "managers": {MANAGER: {"type": "naive"}},
        "default_manager": MANAGER,
        "pipeline": {"num_workers": 2},
        "logging": {"level": "WARNING"},
    }


def item_fields(k: int) -> dict[str, str]:
    answer = 42 + k % 997 if k % 4 else 41
    return {
        "item_id": f"item-{k}",
        "data_source": "gsm8k",
        "prompt": "Tom has 6 bags of 7 apples. How many apples does he have?",
        "response": f"6 bags of 7 apples is 6 * 7 = {answer} apples.\n#### {answer}",
        "ground_truth": str(42 + k % 997),
    }


# --- the open-loop schedule, shared by both sides ------------------------------------------


@dataclass
class Sample:
    """What one side measured: per measured item its due time and its result time."""

    due: dict[str, float]
    done: dict[str, float]
    max_lag_s: float  # how far behind schedule the sender was at worst
    bad: int  # results with a status other than OK / POLICY_FAIL


async def drive(
    send: Callable[[int], Awaitable[None]],
    due: dict[str, float],
    rate: float,
    duration_s: float,
    warmup_s: float,
) -> float:
    """Send item k at start + k / rate (warm-up items first, not recorded in `due`); returns
    the worst lag behind the schedule."""
    warm, measured = int(rate * warmup_s), int(rate * duration_s)
    start = time.monotonic() + 0.05
    max_lag = 0.0
    for k in range(warm + measured):
        when = start + k / rate
        delay = when - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            max_lag = max(max_lag, -delay)
        if k >= warm:
            due[f"item-{k}"] = when
        await send(k)
    return max_lag


async def wait_for(done: dict[str, float], due: dict[str, float], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(item_id not in done for item_id in due):
        if time.monotonic() > deadline:
            missing = sum(1 for item_id in due if item_id not in done)
            raise RuntimeError(f"{missing} results missing {timeout_s:.0f} s after the last send")
        await asyncio.sleep(0.01)


# --- grpc: the client process ----------------------------------------------------------------


async def grpc_client(target: str, rate: float, duration_s: float, warmup_s: float) -> Sample:
    from relayrl.core.grpc_client import make_channel
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.proto.reward.v1 import reward_pb2, reward_pb2_grpc

    ok = (common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_POLICY_FAIL)
    channel = make_channel(target, default_timeout_s=600.0)
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    due: dict[str, float] = {}
    done: dict[str, float] = {}
    bad = 0
    items = [
        reward_pb2.ScoreStreamRequest(item=common_pb2.RewardItem(**item_fields(k)))
        for k in range(int(rate * warmup_s) + int(rate * duration_s))
    ]
    try:
        await stub.ListManagers(reward_pb2.ListManagersRequest())  # connect before the clock
        call = stub.ScoreStream(timeout=warmup_s + duration_s + 120)
        await call.write(
            reward_pb2.ScoreStreamRequest(options=reward_pb2.ScoreOptions(manager=MANAGER))
        )

        async def read() -> None:
            nonlocal bad
            async for response in call:
                done[response.result.item_id] = time.monotonic()
                bad += response.result.status not in ok

        reader = asyncio.create_task(read())

        async def send(k: int) -> None:
            await call.write(items[k])

        max_lag = await drive(send, due, rate, duration_s, warmup_s)
        await call.done_writing()
        async with asyncio.timeout(120):
            await reader
    finally:
        await channel.close()
    return Sample(due, done, max_lag, bad)


def run_grpc(target: str, rate: float, args: argparse.Namespace) -> Sample:
    """This script with --client, in a child process; its JSON answer on stdout."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--client",
        target,
        "--rate",
        str(rate),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        out, _ = process.communicate(timeout=args.warmup + args.duration + 180)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"the gRPC client exited {process.returncode}")
    raw = json.loads(out.decode().strip().splitlines()[-1])
    return Sample(raw["due"], raw["done"], raw["max_lag_s"], raw["bad"])


# --- inprocess ---------------------------------------------------------------------------


async def inprocess(rate: float, args: argparse.Namespace) -> Sample:
    from prometheus_client import CollectorRegistry

    from relayrl.reward.config import RewardConfig
    from relayrl.reward.items import RewardItem, Status
    from relayrl.reward.lanes import SubmitOptions
    from relayrl.reward.server import RewardApp

    app = RewardApp(RewardConfig.model_validate(config_dict()), CollectorRegistry())
    await app.start()
    pipeline = app.pipeline
    options = SubmitOptions(manager=MANAGER)
    due: dict[str, float] = {}
    done: dict[str, float] = {}
    bad = 0
    items = [
        RewardItem(**item_fields(k))
        for k in range(int(rate * args.warmup) + int(rate * args.duration))
    ]

    async def send(k: int) -> None:
        item = items[k]
        handle = await pipeline.submit([item], options)

        def finished(future: asyncio.Future[Any]) -> None:
            nonlocal bad
            done[item.item_id] = time.monotonic()
            bad += future.result().status not in (Status.OK, Status.POLICY_FAIL)
            pipeline.forget(handle)

        handle.entries[0].future.add_done_callback(finished)

    try:
        max_lag = await drive(send, due, rate, args.duration, args.warmup)
        await wait_for(done, due, 120)
    finally:
        await app.close()
    return Sample(due, done, max_lag, bad)


# --- the benchmark ---------------------------------------------------------------------------


@dataclass
class Result:
    side: str
    rate: float
    achieved: float
    p50_ms: float
    p99_ms: float
    max_lag_ms: float
    received: int
    sent: int


def summarize(side: str, rate: float, sample: Sample) -> Result:
    if sample.bad:
        raise RuntimeError(f"{side}: {sample.bad} results with an unexpected status")
    latencies = sorted(sample.done[i] - t for i, t in sample.due.items() if i in sample.done)
    if not latencies:
        raise RuntimeError(f"{side}: no results")
    first_due = min(sample.due.values())
    last_done = max(sample.done[i] for i in sample.due if i in sample.done)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return Result(
        side,
        rate,
        len(latencies) / (last_done - first_due),
        pct(0.50),
        pct(0.99),
        sample.max_lag_s * 1000,
        len(latencies),
        len(sample.due),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2000.0, help="offered items/s (sustained)")
    parser.add_argument("--over-rate", type=float, default=5000.0, help="a higher load; 0: skip")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--client", metavar="TARGET", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.client:  # the gRPC client process
        sample = asyncio.run(grpc_client(args.client, args.rate, args.duration, args.warmup))
        print(json.dumps(sample.__dict__))
        return

    from relayrl.core.service_process import ServiceProcess
    from relayrl_testkit.helpers.signals import raise_on_sigterm

    raise_on_sigterm()
    rates = [args.rate] + ([args.over_rate] if args.over_rate > 0 else [])
    print(
        f"reward-load-bench: naive/gsm8k, ScoreStream from a client process vs RewardPipeline "
        f"in-process; open-loop, {args.warmup:g} s warm-up + {args.duration:g} s per run",
        flush=True,
    )
    results: list[Result] = []
    service = ServiceProcess("relayrl-reward", config_dict())
    started = time.monotonic()
    try:
        service.start()
        for index, rate in enumerate(rates):
            sides = ["grpc", "inprocess"] if index % 2 == 0 else ["inprocess", "grpc"]
            for side in sides:
                if side == "grpc":
                    sample = run_grpc(service.target, rate, args)
                else:
                    sample = asyncio.run(inprocess(rate, args))
                result = summarize(side, rate, sample)
                results.append(result)
                print(
                    f"  {side:<9} offered {rate:6.0f}/s  achieved {result.achieved:6.0f}/s  "
                    f"p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:8.2f} ms",
                    flush=True,
                )
    finally:
        service.stop()

    print()
    print(
        f"{'offered':>8}  {'side':<9} {'achieved':>9} {'p50':>9} {'p99':>10} "
        f"{'max lag':>9} {'received':>9}"
    )
    for r in results:
        print(
            f"{r.rate:7.0f}/s  {r.side:<9} {r.achieved:7.0f}/s {r.p50_ms:6.2f} ms "
            f"{r.p99_ms:7.2f} ms {r.max_lag_ms:6.1f} ms {r.received:>5}/{r.sent}"
        )
    print(
        "max lag: how far the sender fell behind its schedule at worst (latency counts from "
        f"the due time). (total {time.monotonic() - started:.0f} s)"
    )
    grpc = next(r for r in results if r.side == "grpc" and r.rate == args.rate)
    local = next(r for r in results if r.side == "inprocess" and r.rate == args.rate)
    print(
        f"reward-load-bench: grpc={grpc.achieved:.0f}/s p50={grpc.p50_ms:.2f} "
        f"p99={grpc.p99_ms:.2f} inprocess={local.achieved:.0f}/s p50={local.p50_ms:.2f} "
        f"p99={local.p99_ms:.2f} latency_ratio_p50={grpc.p50_ms / local.p50_ms:.2f}"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; the child processes are stopped", file=sys.stderr)
        sys.exit(130)
