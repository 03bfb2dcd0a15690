"""TransferQueue vs raw pipelined redis-py, side by side, on 2048-token trajectories.

Every side moves the same bytes through the same private redis-server (AOF everysec) for the
same pipeline, one round = `--groups` prompt groups of `--samples` trajectories:

    tq:    put_groups -> claim_groups -> put_trajectories -> reward consumer (read events,
           get_trajectories, score_trajectories, ack) -> consume(step) + get_groups,
           through the asyncio client (AsyncTransferQueue, what the gateway and the
           reward-service use) and, as `sync`, through TransferQueue (the trainer's)
    raw:   pipelined SET of each group's bytes -> pipelined SET of each trajectory's bytes ->
           pipelined GET of the trajectories + SET of their rewards (the scorer) ->
           pipelined GET of the groups, trajectories and rewards (the trainer), on redis-py's
           sync client

Serialising messages before a write and parsing them after a read are on both sides (a real
consumer must parse what it reads), so the ratio is what the queue's bookkeeping costs: status
checks, the atomic transitions, indexes, events, acks, validation and idempotency digests.
Runs rotate which side goes first, each on an empty Redis, so that noise on this shared
machine hits all alike.

The last line is exactly: tq-bench: ratio=<tq_rate/raw_rate> tq=<N>/s raw=<M>/s
(rates in trajectories per second, the median over the runs; tq is the asyncio client's). The
line before it gives the sync client's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import redis

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    AsyncEventConsumer,
    AsyncTransferQueue,
    EventConsumer,
    TrajectoryPut,
    TransferQueue,
)
from relayrl.tq.server import RedisServer

PARTITION = "train"
VOCAB = 151_000


def make_round(
    rng: random.Random, tag: str, groups: int, samples: int, prompt_len: int, response_len: int
) -> tuple[list[common_pb2.PromptGroup], list[common_pb2.Trajectory]]:
    prompts, trajectories = [], []
    for g in range(groups):
        uid = f"{tag}-g{g}"
        prompt = rng.choices(range(VOCAB), k=prompt_len)
        prompts.append(
            common_pb2.PromptGroup(
                uid=uid,
                prompt_step=0,
                num_samples=samples,
                prompt_token_ids=prompt,
                data_source="arith",
                ground_truth="42",
            )
        )
        for i in range(samples):
            trajectories.append(
                common_pb2.Trajectory(
                    uid=uid,
                    index=i,
                    prompt_token_ids=prompt,
                    response_token_ids=rng.choices(range(VOCAB), k=response_len),
                    response_mask=b"\x01" * response_len,
                    rollout_logprobs=[-rng.random() for _ in range(response_len)],
                    spans=[common_pb2.GenerationSpan(start=0, end=response_len, generated=True)],
                )
            )
    return prompts, trajectories


def reward_for(traj: common_pb2.Trajectory) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(
        item_id=f"{traj.uid}_{traj.index}",
        status=common_pb2.REWARD_STATUS_OK,
        score=float(traj.response_token_ids[-1] % 2),
    )


SCORER: dict[str, Any] = {
    "group": "reward",
    "reader": "bench",
    "wants": {("trajectory", "finished")},
}


class Inline:
    """The methods of a sync client behind `await`, called in place (no thread), so that one
    round serves both clients."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._target, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return call


async def sync_scorer(tq: TransferQueue) -> Inline:
    return Inline(EventConsumer(tq, PARTITION, **SCORER))  # joins its group when built


async def async_scorer(tq: AsyncTransferQueue) -> AsyncEventConsumer:
    scorer = AsyncEventConsumer(tq, PARTITION, **SCORER)
    await scorer.create_group()
    return scorer


async def run_tq(
    tq: AsyncTransferQueue | Inline,
    open_scorer: Callable[[], Awaitable[Any]],
    step: int,
    prompts,
    trajectories,
    samples: int,
) -> None:
    await tq.put_groups(PARTITION, prompts)
    claimed = await tq.claim_groups(PARTITION, max_groups=len(prompts), claimer="bench", lease_s=60)
    claims = {c.group.uid: c.claim_id for c in claimed.claimed}
    for start in range(0, len(trajectories), 64):
        chunk = trajectories[start : start + 64]
        await tq.put_trajectories(PARTITION, [TrajectoryPut(t, claims[t.uid]) for t in chunk])
    scorer = await open_scorer()
    num_scored = 0
    while num_scored < len(trajectories):
        events = await scorer.read(count=256, block_s=1.0)
        read = await tq.get_trajectories(PARTITION, [e.key for e in events])
        await tq.score_trajectories(PARTITION, {f"{t.uid}_{t.index}": reward_for(t) for t in read})
        await scorer.ack(events)
        num_scored += len(events)
    uids = await tq.consume(PARTITION, step, len(prompts))
    batch = await tq.get_groups(PARTITION, uids)
    assert sum(len(g.trajectories) for g in batch) == len(prompts) * samples


def run_raw(client: redis.Redis, tag: str, prompts, trajectories) -> None:
    pipe = client.pipeline(transaction=False)
    for p in prompts:
        pipe.set(f"raw:{tag}:g:{p.uid}", p.SerializeToString())
    pipe.execute()
    keys = [f"raw:{tag}:t:{t.uid}_{t.index}" for t in trajectories]
    for start in range(0, len(trajectories), 64):
        pipe = client.pipeline(transaction=False)
        for key, t in zip(keys[start : start + 64], trajectories[start : start + 64], strict=True):
            pipe.set(key, t.SerializeToString())
        pipe.execute()
    for start in range(0, len(keys), 256):
        chunk = keys[start : start + 256]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            pipe.get(key)
        read = [common_pb2.Trajectory.FromString(b) for b in pipe.execute()]
        pipe = client.pipeline(transaction=False)
        for key, t in zip(chunk, read, strict=True):
            pipe.set(f"{key}:reward", reward_for(t).SerializeToString())
        pipe.execute()
    pipe = client.pipeline(transaction=False)
    for p in prompts:
        pipe.get(f"raw:{tag}:g:{p.uid}")
    for key in keys:
        pipe.get(key)
        pipe.get(f"{key}:reward")
    replies = pipe.execute()
    _ = [common_pb2.PromptGroup.FromString(b) for b in replies[: len(prompts)]]
    rest = replies[len(prompts) :]
    _ = [common_pb2.Trajectory.FromString(b) for b in rest[::2]]
    _ = [common_pb2.RewardResult.FromString(b) for b in rest[1::2]]
    assert len(rest) == 2 * len(trajectories)


async def inline(function: Callable[..., None], *args: Any) -> None:
    function(*args)


def report(run: int, rates: dict[str, list[float]]) -> None:
    last = {side: values[-1] for side, values in rates.items()}
    print(
        f"run {run}: tq {last['tq']:8.0f}/s  sync {last['sync']:8.0f}/s  raw {last['raw']:8.0f}/s"
        f"  ratio {last['tq'] / last['raw']:.2f} (sync {last['sync'] / last['raw']:.2f})"
    )


async def bench(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    num_traj = args.groups * args.samples
    rates: dict[str, list[float]] = {"tq": [], "sync": [], "raw": []}
    with tempfile.TemporaryDirectory() as data_dir, RedisServer(data_dir) as server:
        client = server.client()
        tq = TransferQueue(client)
        async with AsyncTransferQueue(server.async_client()) as atq:
            for run in range(args.runs + 1):  # run 0 warms every path up and is not counted
                prompts, trajectories = make_round(
                    rng, f"r{run}", args.groups, args.samples, args.prompt_len, args.response_len
                )
                tq_round = partial(
                    run_tq,
                    step=run,
                    prompts=prompts,
                    trajectories=trajectories,
                    samples=args.samples,
                )
                sides: dict[str, Callable[[], Awaitable[None]]] = {
                    "tq": partial(tq_round, atq, partial(async_scorer, atq)),
                    "sync": partial(tq_round, Inline(tq), partial(sync_scorer, tq)),
                    "raw": partial(inline, run_raw, client, f"r{run}", prompts, trajectories),
                }
                # Rotate which side goes first, and start every side on an empty Redis, so that
                # none always meets a bigger dataset, a warmer cache or an AOF rewrite.
                names = list(sides)
                for side in names[run % 3 :] + names[: run % 3]:
                    client.flushall()
                    tq.create_partition(PARTITION)
                    start = time.perf_counter()
                    await sides[side]()
                    if run:
                        rates[side].append(num_traj / (time.perf_counter() - start))
                if run:
                    report(run, rates)
        size = len(trajectories[0].SerializeToString())
        tq.close()
    tq_rate, sync_rate, raw_rate = (statistics.median(rates[s]) for s in ("tq", "sync", "raw"))
    print(
        f"{args.runs} runs x {num_traj} trajectories of {args.prompt_len}+{args.response_len} "
        f"tokens ({size} bytes each), redis-server AOF everysec"
    )
    print(f"tq-bench sync client: ratio={sync_rate / raw_rate:.2f} tq={sync_rate:.0f}/s")
    print(f"tq-bench: ratio={tq_rate / raw_rate:.2f} tq={tq_rate:.0f}/s raw={raw_rate:.0f}/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64, help="prompt groups per round")
    parser.add_argument("--samples", type=int, default=8, help="trajectories per group")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=1536)
    parser.add_argument("--runs", type=int, default=9, help="rounds per side (rotating)")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
