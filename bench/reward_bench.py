"""The generative-judge reward benchmark of docs/rewards.md#reference-benchmark, reproduced
against the real reward-service process and the simulated vLLM judge
(`relayrl_testkit.judge_sim`) process.

Workload, as in the seed: 32 items per step, `pipeline.num_workers: 2`, judge verdicts of 200
tokens, judge timing of a continuously batching vLLM (decode step 25 ms growing 4.7% per extra
sequence, prefill 0.3 s); every duration (judge, sampling window, micro-batch timeout) is
multiplied by one `--time-scale` so the whole run fits in a few minutes. One service holds two
genrm managers on the same judge: `judge` (no micro-batching) and `judge_mb` (micro_batch_size
16, micro_batch_timeout_ms 200 x scale, max_inflight_calls 16).

The client plays the sampler: over a sampling window W (seed: ~40 s) it emits each item when
its sequence finishes. Two arrival patterns:
    short     all 32 sequences finish in the last 2.5% of W (no overlap window)
    longtail  the first at 40% of W, then dense early and sparse late: 0.4 + 0.6 (i/31)^2 of W
              (long-tail generation)
Three modes per pattern:
    whole        wait for the last arrival, then one Submit of all 32 (manager `judge`, split
                 into 2 chunks of 16 by the 2 workers) + Collect: the reference's path A
    per-item     one ScoreStream, each item written at its arrival, manager `judge`
    per-item+mb  the same stream on `judge_mb`
Metric: t_collect = from the last arrival (the end of sampling) until every result is back.
Nothing is sent before the last arrival in `whole` mode, so that mode does not sleep through
the window (the judge is idle either way); the streaming modes start the clock at the first
arrival, the idle part of the window before it is skipped too.

Per run the judge's counters are reset and its request log read back (`/stats`, monotonic
times of the same clock as this process): judge requests, items per request, and `floor`, the
duration of the one judge request that carried the last-arriving item in a per-item+mb run
(the least any streaming mode can take after the last arrival: that item's own verdict).
Cheap modes are the median of `--runs` runs (order alternating); per-item without
micro-batching (~88 s at seed scale) runs `--per-item-runs` times.

The last two lines are exactly:
    reward-bench short: microbatch/whole=<r1>
    reward-bench longtail: whole/microbatch=<r2> microbatch/floor=<r3>
(t_collect ratios; r3 is the median over the per-item+mb runs of t_collect / floor).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from relayrl.core.grpc_client import make_channel
from relayrl.core.service_process import ServiceProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2, reward_pb2_grpc
from relayrl_testkit.helpers.signals import raise_on_sigterm
from relayrl_testkit.judge_launcher import JudgeSimProcess, start_judge_sim

ITEMS = 32
WORKERS = 2
VERDICT_TOKENS = 200
STEP_S, STEP_GROWTH, PREFILL_S = 0.025, 0.047, 0.3
# The reference benchmark's sampling window (t_sample ~41-43 s; docs/rewards.md).
WINDOW_S = 40.0
MB_SIZE, MB_TIMEOUT_MS, MB_INFLIGHT = 16, 200.0, 16
OK_STATUSES = (common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_POLICY_FAIL)
PATTERNS = ("short", "longtail")
MODES = ("whole", "per-item", "per-item+mb")
# The reference benchmark's figures at full scale (docs/rewards.md#reference-benchmark):
# t_collect (s), judge requests per step, items per request.
SEED: dict[tuple[str, str], tuple[float, float, float]] = {
    ("short", "whole"): (8.93, 2, 16.0),  # one request per worker
    ("short", "per-item"): (85.55, 32, 1.0),  # one request per item
    ("short", "per-item+mb"): (13.6, 8 / 3, 12.0),  # MB 16 / 200 ms
    ("longtail", "whole"): (11.49, 2, 16.0),  # one request per worker
    ("longtail", "per-item"): (68.4, 32, 1.0),  # no micro-batching
    ("longtail", "per-item+mb"): (7.10, 20, 1.6),  # MB 16 / 200 ms
}


# --- the reward-service as a child process ---------------------------------------------------


def reward_service(config: dict[str, Any]) -> ServiceProcess:
    """relayrl-reward with `config`, in a temporary directory removed by stop()."""
    return ServiceProcess("relayrl-reward", config)


# --- workload --------------------------------------------------------------------------------


def arrival_fractions(pattern: str, n: int) -> list[float]:
    """When each sequence finishes, as a fraction of the sampling window (sorted)."""
    last = max(1, n - 1)
    if pattern == "short":
        return [0.975 + 0.025 * i / last for i in range(n)]
    return [0.4 + 0.6 * (i / last) ** 2 for i in range(n)]


def make_items(tag: str, n: int) -> list[common_pb2.RewardItem]:
    """Items whose judge prompt carries `ITEM: <id>` (the judge_sim logs it per request); the
    sim's verdict is VERDICT_TOKENS words, every one decoded (max_tokens is that many)."""
    items = []
    for i in range(n):
        item_id = f"{tag}-i{i:02d}"
        items.append(
            common_pb2.RewardItem(
                item_id=item_id,
                data_source="gsm8k",
                prompt=f"A shop sells 6 boxes of 7 pens. How many pens?\nITEM: {item_id}",
                response="42" if i % 4 else "41",
                ground_truth="42",
            )
        )
    return items


def service_config(judge_url: str, scale: float) -> dict[str, Any]:
    judge = {
        "type": "genrm",
        "base_url": judge_url,
        "model": "judge",
        "max_tokens": VERDICT_TOKENS,
        "max_concurrent": 64,
    }
    return {
        "managers": {
            "judge": {**judge, "batching": {"micro_batch_size": 0}},
            "judge_mb": {
                **judge,
                "batching": {
                    "micro_batch_size": MB_SIZE,
                    "micro_batch_timeout_ms": MB_TIMEOUT_MS * scale,
                    "max_inflight_calls": MB_INFLIGHT,
                },
            },
        },
        "default_manager": "judge",
        "pipeline": {"num_workers": WORKERS},
        "logging": {"level": "WARNING"},
    }


# --- one measurement -------------------------------------------------------------------------


@dataclass
class Run:
    pattern: str
    mode: str
    t_collect: float
    requests: int
    items_per_request: float
    floor: float | None = None  # duration of the judge request carrying the last item
    lane_wait: float | None = None  # last arrival -> that request reaching the judge
    batches: list[tuple[int, float, float]] = field(default_factory=list)  # items, start, end


async def _sleep_until(when: float) -> None:
    delay = when - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _wait_idle(judge: JudgeSimProcess) -> None:
    for _ in range(500):
        if judge.stats()["inflight"] == 0:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the judge still has requests in flight between runs")


def _check(results: list[common_pb2.RewardResult], items: list[common_pb2.RewardItem]) -> None:
    if sorted(r.item_id for r in results) != sorted(i.item_id for i in items):
        raise RuntimeError("results do not match the items sent")
    for result in results:
        if result.status not in OK_STATUSES:
            name = common_pb2.RewardStatus.Name(result.status)
            raise RuntimeError(f"{result.item_id}: {name}: {result.message}")


async def run_whole(
    stub: reward_pb2_grpc.RewardServiceStub, items: list[common_pb2.RewardItem]
) -> tuple[float, float]:
    """(t_collect, the last arrival's monotonic time)."""
    last_arrival = time.monotonic()  # nothing happens before it in this mode
    options = reward_pb2.ScoreOptions(manager="judge")
    handle = await stub.Submit(reward_pb2.SubmitRequest(items=items, options=options), timeout=60)
    while True:
        collected = await stub.Collect(
            reward_pb2.CollectRequest(handle=handle.handle, wait_s=30.0), timeout=60
        )
        if collected.done:
            break
    done = time.monotonic()
    _check(list(collected.results), items)
    return done - last_arrival, last_arrival


async def run_stream(
    stub: reward_pb2_grpc.RewardServiceStub,
    manager: str,
    items: list[common_pb2.RewardItem],
    offsets: list[float],
) -> tuple[float, float]:
    """(t_collect, the last arrival's monotonic time)."""
    call = stub.ScoreStream(timeout=600)
    await call.write(
        reward_pb2.ScoreStreamRequest(options=reward_pb2.ScoreOptions(manager=manager))
    )
    received: list[tuple[float, common_pb2.RewardResult]] = []

    async def read() -> None:
        async for response in call:
            received.append((time.monotonic(), response.result))

    reader = asyncio.create_task(read())
    try:
        start = time.monotonic() + 0.02
        last_arrival = start
        for item, offset in zip(items, offsets, strict=True):
            await _sleep_until(start + offset)
            last_arrival = time.monotonic()
            await call.write(reward_pb2.ScoreStreamRequest(item=item))
        await call.done_writing()
        await reader
    finally:
        reader.cancel()
    _check([result for _, result in received], items)
    return max(at for at, _ in received) - last_arrival, last_arrival


async def measure(
    stub: reward_pb2_grpc.RewardServiceStub,
    judge: JudgeSimProcess,
    pattern: str,
    mode: str,
    run: int,
    window_s: float,
) -> Run:
    tag = f"{pattern}-{mode.replace('+', '')}-r{run}"
    items = make_items(tag, ITEMS)
    fractions = arrival_fractions(pattern, ITEMS)
    offsets = [(f - fractions[0]) * window_s for f in fractions]
    await _wait_idle(judge)
    judge.reset_stats()
    if mode == "whole":
        t_collect, last_arrival = await run_whole(stub, items)
    else:
        manager = "judge_mb" if mode == "per-item+mb" else "judge"
        t_collect, last_arrival = await run_stream(stub, manager, items, offsets)
    stats = judge.stats()
    log = [e for e in stats["request_log"] if e["endpoint"] == "/v1/completions"]
    requests = len(log)
    items_per_request = sum(e["items"] for e in log) / max(1, requests)
    result = Run(pattern, mode, t_collect, requests, items_per_request)
    result.batches = [
        (e["items"], e["start_s"] - last_arrival, e["end_s"] - last_arrival) for e in log
    ]
    last_id = items[-1].item_id
    carrying = [e for e in log if last_id in e["tags"]]
    if carrying:
        entry = carrying[-1]
        result.floor = entry["end_s"] - entry["start_s"]
        result.lane_wait = entry["start_s"] - last_arrival
    return result


# --- the whole benchmark ---------------------------------------------------------------------


async def bench(
    target: str, judge: JudgeSimProcess, args: argparse.Namespace
) -> dict[tuple[str, str], list[Run]]:
    window_s = WINDOW_S * args.time_scale
    channel = make_channel(target, default_timeout_s=600.0)
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    runs: dict[tuple[str, str], list[Run]] = {}
    try:
        # Warm-up: the managers' HTTP sessions, the gRPC connection, the judge's first request.
        warm = make_items("warmup", 2)
        await asyncio.gather(
            run_stream(stub, "judge", warm[:1], [0.0]),
            run_stream(stub, "judge_mb", warm[1:], [0.0]),
        )
        for pattern in PATTERNS:
            for run in range(args.runs):
                modes = ["whole", "per-item+mb"]
                for mode in modes if run % 2 == 0 else modes[::-1]:
                    result = await measure(stub, judge, pattern, mode, run, window_s)
                    runs.setdefault((pattern, mode), []).append(result)
                    progress(result, args.time_scale)
            for run in range(args.per_item_runs):
                result = await measure(stub, judge, pattern, "per-item", run, window_s)
                runs.setdefault((pattern, "per-item"), []).append(result)
                progress(result, args.time_scale)
    finally:
        await channel.close()
    return runs


def progress(run: Run, scale: float) -> None:
    line = (
        f"  {run.pattern:<9} {run.mode:<12} t_collect {run.t_collect:6.2f} s "
        f"({run.t_collect / scale:5.1f} s seed scale)  judge requests {run.requests:>2}"
    )
    if run.mode == "per-item+mb" and run.floor is not None:
        sizes = ",".join(str(items) for items, _, _ in run.batches)
        line += (
            f"  batches [{sizes}]  last item: sent +{run.lane_wait * 1000:.0f} ms after its "
            f"arrival, its request took {run.floor:.2f} s (floor)"
        )
    print(line, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(runs: dict[tuple[str, str], list[Run]], scale: float) -> None:
    print()
    print(
        f"{'':<22} {'t_collect':>9} {'@seed':>8} {'seed':>7}   {'judge requests':>14}   "
        f"{'items/request':>13}"
    )
    print(
        f"{'pattern':<9} {'mode':<12} {'scaled':>9} {'scale':>8} {'':>7}   {'this':>6} "
        f"{'seed':>7}   {'this':>6} {'seed':>6}  runs"
    )
    for pattern in PATTERNS:
        for mode in MODES:
            done = runs.get((pattern, mode), [])
            if not done:
                continue
            t = median([r.t_collect for r in done])
            requests = median([float(r.requests) for r in done])
            per = median([r.items_per_request for r in done])
            seed_t, seed_requests, seed_per = SEED[(pattern, mode)]
            print(
                f"{pattern:<9} {mode:<12} {t:8.2f}s {t / scale:7.1f}s {seed_t:6.2f}s   "
                f"{requests:6.0f} {seed_requests:7.1f}   {per:6.1f} {seed_per:6.1f}  {len(done):>4}"
            )
        mb = runs.get((pattern, "per-item+mb"), [])
        floors = [r.floor for r in mb if r.floor is not None]
        if floors:
            print(
                f"{pattern:<9} {'floor':<12} {median(floors):8.2f}s "
                f"{median(floors) / scale:7.1f}s   (judge request carrying the last item, "
                "per-item+mb runs)"
            )
    print(
        "t_collect: last arrival -> every result back (median of the runs); @seed scale: "
        "divided by the time scale; seed: the reference benchmark's figures "
        "(docs/rewards.md#reference-benchmark), judge requests per step."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-scale", type=float, default=0.2, help="multiplies every duration (seed: 1)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of whole and per-item+mb")
    parser.add_argument(
        "--per-item-runs", type=int, default=1, help="runs of per-item without micro-batching"
    )
    args = parser.parse_args()
    scale = args.time_scale
    raise_on_sigterm()
    print(
        f"reward-bench: {ITEMS} items/step, {WORKERS} workers, verdict {VERDICT_TOKENS} tokens, "
        f"judge step {STEP_S * 1000:.0f} ms (+{STEP_GROWTH:.1%}/seq), prefill {PREFILL_S} s, "
        f"micro-batch {MB_SIZE}/{MB_TIMEOUT_MS:.0f} ms; time scale {scale:g} "
        f"(window {WINDOW_S * scale:.1f} s = {WINDOW_S:.0f} s at seed scale)",
        flush=True,
    )
    judge: JudgeSimProcess | None = None
    service: ServiceProcess | None = None
    started = time.monotonic()
    try:
        judge = start_judge_sim(
            time_scale=scale,
            step_s=STEP_S,
            step_growth=STEP_GROWTH,
            prefill_s=PREFILL_S,
            verdict_tokens=VERDICT_TOKENS,
        )
        service = reward_service(service_config(judge.url, scale)).start()
        runs = asyncio.run(bench(service.target, judge, args))
    finally:
        if service is not None:
            service.stop()
        if judge is not None:
            judge.stop()
    report(runs, scale)
    print(f"(total {time.monotonic() - started:.0f} s)")

    def t(pattern: str, mode: str) -> float:
        return median([r.t_collect for r in runs[(pattern, mode)]])

    longtail_mb = runs[("longtail", "per-item+mb")]
    r3 = median([r.t_collect / r.floor for r in longtail_mb if r.floor])
    r1 = t("short", "per-item+mb") / t("short", "whole")
    print(f"reward-bench short: microbatch/whole={r1:.2f}")
    print(
        f"reward-bench longtail: whole/microbatch="
        f"{t('longtail', 'whole') / t('longtail', 'per-item+mb'):.2f} microbatch/floor={r3:.2f}"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; the child processes are stopped", file=sys.stderr)
        sys.exit(130)
