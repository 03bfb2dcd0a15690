"""Rollouts through the real rollout-gateway vs the same requests sent straight to the engine,
side by side in one run, on one real vLLM engine serving the tiny model.

One round = `--groups` prompt groups of `--samples` samples: fixed prompt token ids (per
group), temperature 1, `--max-tokens` per sample, seed `group_seed + index` per sample.

    direct:   one VllmEngineClient (kept across rounds, as the gateway keeps its own) sends all
              groups x samples generate requests at once (the concurrency the gateway reaches:
              it claims every group in one call and rolls out all of a group's samples at once),
              with exactly the sampling the gateway's single_turn loop sends (the same seeds, the
              same stop token `<|im_end|>`); the clock stops at the last answer.
    gateway:  the groups are put in a private redis-server's TransferQueue; the gateway process
              claims them, rolls them out on the same engine and writes every trajectory back;
              the clock runs from before put_groups to the moment this process reads the last
              trajectory's `finished` event (a blocking XREAD on the partition's event stream,
              so waiting costs no CPU).

The gateway's SamplingParams cannot say ignore_eos, so samples may stop early at `<|im_end|>`:
both sides count the tokens actually generated (identical when the engine's per-request seeded
sampling repeats, which the table shows). Tokens/s = generated tokens / seconds.

Rounds alternate which side goes first; round 0 warms both up and is not counted; the result
is the median over `--runs` rounds. Per gateway round, the breakdown (from the event stream's
Redis timestamps and the trajectories' own timings) shows where the time goes:
    claim    put_groups' event -> the first group claimed (the claim loop's idle polling)
    launch   the first claim -> the first rollout started
    rollout  the first rollout started -> the last trajectory built (generation)
    write    the last trajectory built -> its put_trajectories event
    notice   that event -> this process read it
and `cpu` is the client side's CPU seconds: this process for direct, the gateway process for
gateway (HTTP, JSON, protobuf, TQ writes and polling: what competes with the engine for cores).

The last line is exactly: gateway-bench: ratio=<gateway_tokens_per_s/direct_tokens_per_s>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from relayrl.core.service_process import ServiceProcess
from relayrl.engine.config import EngineConfig
from relayrl.engine.process import EngineProcess
from relayrl.inference.client import GenerateRequest, SamplingOptions, VllmEngineClient
from relayrl.models.tiny import TinyModelConfig, init_model
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.signals import raise_on_sigterm

PARTITION = "train"
PROMPT_LEN = 32
FIRST_TOKEN, LAST_TOKEN = 10, 500  # plain (non-special) ids of the tiny model's 512 vocabulary
ROUND_TIMEOUT_S = 120.0
BREAKDOWN = ("claim", "launch", "rollout", "write", "notice")


# --- workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # per group
    seeds: list[int]  # per group; sample i uses seed + i
    samples: int
    max_tokens: int

    def groups(self, tag: str) -> list[common_pb2.PromptGroup]:
        return [
            common_pb2.PromptGroup(
                uid=f"{tag}-g{g}",
                num_samples=self.samples,
                prompt_step=0,
                prompt_token_ids=prompt,
                data_source="bench",
                ground_truth="-",
                sampling=common_pb2.SamplingParams(
                    temperature=1.0, max_response_tokens=self.max_tokens, seed=self.seeds[g]
                ),
            )
            for g, prompt in enumerate(self.prompts)
        ]


def make_workload(groups: int, samples: int, max_tokens: int) -> Workload:
    rng = random.Random(0)
    prompts = [rng.choices(range(FIRST_TOKEN, LAST_TOKEN), k=PROMPT_LEN) for _ in range(groups)]
    return Workload(prompts, [1000 * (g + 1) for g in range(groups)], samples, max_tokens)


# --- the two sides ---------------------------------------------------------------------------


@dataclass
class Result:
    tokens: int
    seconds: float
    # CPU seconds of the client side: this process (direct) or the gateway process (gateway).
    cpu_s: float = 0.0
    breakdown: dict[str, float] | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> str:
        text = f"{self.tokens} tok {self.seconds:5.2f} s {self.rate:5.0f} tok/s"
        text += f" cpu {self.cpu_s:4.2f}"
        if self.breakdown:
            text += " [" + " ".join(f"{k} {v:.2f}" for k, v in self.breakdown.items()) + "]"
        return text


async def run_direct(
    client: VllmEngineClient, work: Workload, tag: str, stop_ids: tuple[int, ...]
) -> Result:
    requests = [
        GenerateRequest(
            f"{tag}-g{g}_{i}-t0",
            tuple(prompt),
            # What the gateway's sampling_for + single_turn send for this sample.
            SamplingOptions(
                max_tokens=work.max_tokens,
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                seed=work.seeds[g] + i,
                stop_token_ids=stop_ids,
            ),
        )
        for g, prompt in enumerate(work.prompts)
        for i in range(work.samples)
    ]
    cpu = time.process_time()
    start = time.perf_counter()
    generations = await asyncio.gather(*(client.generate(r) for r in requests))
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return Result(sum(len(g.token_ids) for g in generations), seconds, cpu)


async def close_client(client: VllmEngineClient) -> None:
    """Cancel what an interrupted round left running, then close the client's connections."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    await client.close()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stream_ms(event_id: str) -> int:
    return int(event_id.split("-")[0])


def run_gateway(tq: TransferQueue, work: Workload, tag: str, gateway: ServiceProcess) -> Result:
    last = tq.last_events(PARTITION, 1)
    cursor = last[0].id if last else "0-0"
    groups = work.groups(tag)
    expected = len(groups) * work.samples
    prefix = tag + "-"
    put_ms = claimed_ms = written_ms = None
    written = failed = 0
    cpu = process_cpu_s(gateway.pid)
    start = time.perf_counter()
    put_wall = time.time()
    tq.put_groups(PARTITION, groups)
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while written < expected:
        if time.monotonic() > deadline or not gateway.alive():
            raise RuntimeError(
                f"gateway round {tag}: {written}/{expected} trajectories after "
                f"{ROUND_TIMEOUT_S} s (gateway alive: {gateway.alive()}):\n{gateway.log()[-4000:]}"
            )
        for event in tq.follow_events(PARTITION, cursor, block_ms=1000, count=1000):
            cursor = event.id
            if not event.key.startswith(prefix):
                continue
            kind, to = event.kind, event.to_status
            if kind == "group" and to == "pending" and put_ms is None:
                put_ms = _stream_ms(event.id)
            elif kind == "group" and to == "running" and claimed_ms is None:
                claimed_ms = _stream_ms(event.id)
            elif kind == "trajectory" and to in ("finished", "failed"):
                written += 1
                failed += to == "failed"
                written_ms = _stream_ms(event.id)
    seconds = time.perf_counter() - start
    cpu = process_cpu_s(gateway.pid) - cpu
    if failed:
        raise RuntimeError(f"gateway round {tag}: {failed} failed trajectories")
    trajectories = [
        t for entry in tq.get_groups(PARTITION, [g.uid for g in groups]) for t in entry.trajectories
    ]
    started = min(t.timings.started_at.ToNanoseconds() for t in trajectories) / 1e9
    finished = max(t.timings.finished_at.ToNanoseconds() for t in trajectories) / 1e9
    if put_ms is None or claimed_ms is None or written_ms is None:
        raise RuntimeError(f"gateway round {tag}: put, claim or write events missing")
    breakdown = {  # the keys of BREAKDOWN, described in the module docstring
        "claim": (claimed_ms - put_ms) / 1e3,
        "launch": started - claimed_ms / 1e3,
        "rollout": finished - started,
        "write": written_ms / 1e3 - finished,
        "notice": put_wall + seconds - written_ms / 1e3,
    }
    tokens = sum(len(t.response_token_ids) for t in trajectories)
    return Result(tokens, seconds, cpu, breakdown)


# --- processes -------------------------------------------------------------------------------


def gateway_config(redis_url: str, model_dir: Path, engine_url: str, groups: int) -> dict:
    return {
        "tq": {"url": redis_url, "partitions": [PARTITION]},
        "tokenizer": str(model_dir),
        "engines": {"urls": [engine_url], "request_timeout_s": 120},
        # Every group of a round in one claim: B = groups, and eta large enough that the
        # throttle never holds a later round back (launched only grows: nothing is consumed).
        "rollout": {"partitions": [PARTITION], "max_inflight_groups": max(64, groups)},
        "rollout_shape": {"batch_groups": groups, "eta": 64},
        "logging": {"level": "WARNING"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="prompt groups per round")
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=512, help="max tokens per sample")
    parser.add_argument("--runs", type=int, default=5, help="counted rounds per side")
    args = parser.parse_args()
    raise_on_sigterm()
    try:
        bench(args)
    except KeyboardInterrupt:
        print("interrupted; the child processes are stopped", file=sys.stderr)
        sys.exit(130)


def bench(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from relayrl.conversation.rendering import turn_end_token_ids

    work = make_workload(args.groups, args.samples, args.max_tokens)
    concurrency = args.groups * args.samples
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        root = Path(tmp)
        model_dir = root / "tiny"
        init_model(model_dir, TinyModelConfig())
        stop_ids = turn_end_token_ids(AutoTokenizer.from_pretrained(model_dir))
        engine = EngineProcess(
            EngineConfig(
                model=model_dir,
                max_model_len=1024,
                max_num_seqs=max(64, concurrency),
                cache_dir=root / "engine" / "cache",
            ),
            root / "engine",
        )
        gateway: ServiceProcess | None = None
        with RedisServer(root / "redis") as server:
            try:
                t0 = time.perf_counter()
                engine.start()
                print(f"engine ready in {time.perf_counter() - t0:.0f} s at {engine.url}")
                config = gateway_config(server.url, model_dir, engine.url, args.groups)
                gateway = ServiceProcess("relayrl-gateway", config, root / "gateway").start()
                tq = TransferQueue(server.client())
                tq.create_partition(PARTITION)
                results = rounds(args, work, stop_ids, engine, tq, gateway)
                tq.close()
            finally:
                if gateway is not None:
                    gateway.stop()
                engine.stop()
    report(args, concurrency, *results)


def rounds(
    args: argparse.Namespace,
    work: Workload,
    stop_ids: tuple[int, ...],
    engine: EngineProcess,
    tq: TransferQueue,
    gateway: ServiceProcess,
) -> tuple[list[Result], list[Result]]:
    direct: list[Result] = []
    through: list[Result] = []
    with asyncio.Runner() as runner:
        engine_client = VllmEngineClient(engine.url, request_timeout_s=ROUND_TIMEOUT_S)
        try:
            for run in range(args.runs + 1):  # round 0 warms both sides up
                sides = ("direct", "gateway") if run % 2 == 0 else ("gateway", "direct")
                line = []
                for side in sides:
                    tag = f"r{run}-{side}"
                    if side == "direct":
                        result = runner.run(run_direct(engine_client, work, tag, stop_ids))
                        (direct if run else []).append(result)
                    else:
                        result = run_gateway(tq, work, tag, gateway)
                        (through if run else []).append(result)
                    line.append(f"{side} {result.summary()}")
                label = "warm-up" if run == 0 else f"round {run}"
                print(f"{label}: " + " | ".join(line), flush=True)
        finally:
            runner.run(close_client(engine_client))
    return direct, through


def report(
    args: argparse.Namespace, concurrency: int, direct: list[Result], through: list[Result]
) -> None:
    print()
    print(
        f"{args.groups} groups x {args.samples} samples ({concurrency} requests at once), "
        f"prompt {PROMPT_LEN} tokens, max_tokens {args.max_tokens}, temperature 1, "
        f"tiny model on one vLLM engine; median of {args.runs} rounds"
    )
    print(f"{'side':<8} {'tokens':>8} {'seconds':>8} {'tokens/s':>9} {'client cpu s':>13}")
    rates = {}
    for side, results in (("direct", direct), ("gateway", through)):
        rates[side] = statistics.median(r.rate for r in results)
        tokens = statistics.median(r.tokens for r in results)
        seconds = statistics.median(r.seconds for r in results)
        cpu = statistics.median(r.cpu_s for r in results)
        print(f"{side:<8} {tokens:>8.0f} {seconds:>8.2f} {rates[side]:>9.0f} {cpu:>13.2f}")
    parts = {k: statistics.median(r.breakdown[k] for r in through) for k in BREAKDOWN}
    print("gateway round, median s: " + " ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    paired = [g.rate / d.rate for g, d in zip(through, direct, strict=True)]
    unclaimed = statistics.median(g.tokens / (g.seconds - g.breakdown["claim"]) for g in through)
    print(
        f"per-round ratios: {' '.join(f'{r:.2f}' for r in paired)}; "
        f"gateway without the claim wait: {unclaimed / rates['direct']:.2f}"
    )
    print(f"gateway-bench: ratio={rates['gateway'] / rates['direct']:.2f}")


if __name__ == "__main__":
    main()
