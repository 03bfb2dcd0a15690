"""Worker processes for the TransferQueue process tests: each role is one real client of the
queue, started by a test with subprocess.Popen, watched through its stdout (one JSON object per
line, flushed at once) and stopped or crashed by PID.

    python -m relayrl_testkit.helpers.tq_workers <role> --port PORT [options of the role]

Roles:
    claim-loop            claims small random batches until nothing (more) can be claimed
    score-half-then-hang  reads a batch of finished-trajectory events, scores the first half,
                          says "scored-half", then hangs without acking (the test SIGKILLs it)
    consume-until-poison  scores and acks finished-trajectory events; on the poison key it
                          crashes (exit 3) without acking, the way a reader dies on a bad entry
    gateway-crash         claims one group with a short lease, writes some of its samples, says
                          so, then hangs (the test SIGKILLs it)

A role that hangs stops by itself after --max-hang-s or when its parent is gone, so a test
runner killed mid-test leaves no orphan behind. Exit codes: 0 done, 2 timed out, 3 crashed on
purpose, 4 hung until --max-hang-s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import EventConsumer, TrajectoryPut, TransferQueue

FINISHED_TRAJECTORIES = frozenset({("trajectory", "finished")})
EXIT_DONE, EXIT_TIMEOUT, EXIT_CRASHED, EXIT_HUNG = 0, 2, 3, 4


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def connect(port: int) -> TransferQueue:
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=10,
        socket_connect_timeout=5,
        retry=Retry(NoBackoff(), 0),
    )
    return TransferQueue(client)


def make_trajectory(uid: str, index: int, writer: str) -> common_pb2.Trajectory:
    num_tokens = 4 + index
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=list(range(100, 100 + num_tokens)),
        response_mask=bytes([1, 0] * num_tokens)[:num_tokens],
        rollout_logprobs=[-0.5] * num_tokens,
        spans=[common_pb2.GenerationSpan(start=0, end=num_tokens, policy_version=0)],
        finish_reason="stop",
        labels={"writer": writer},
    )


def reward(score: float) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(status=common_pb2.REWARD_STATUS_OK, score=score)


def hang(max_hang_s: float) -> int:
    """Blocks like a stuck process until killed; gives up after max_hang_s or without parent."""
    parent = os.getppid()
    deadline = time.monotonic() + max_hang_s
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.1)
    return EXIT_HUNG


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


# -- roles ----------------------------------------------------------------------------------


def claim_loop(args: argparse.Namespace) -> int:
    """After its first claim, waits on a counter in Redis until every worker made its first
    claim: so each worker certainly claims something and the rest runs concurrently."""
    tq = connect(args.port)
    rng = random.Random(args.seed)
    first = True
    while True:
        result = tq.claim_groups(
            args.partition,
            max_groups=rng.randint(1, args.max_batch),
            claimer=args.claimer,
            lease_s=args.lease_s,
            max_launched=args.max_launched,
        )
        uids = [c.group.uid for c in result.claimed]
        say(claimed=uids, num_launched=result.num_launched)
        if first:
            first = False
            tq.redis.incr(args.barrier_key)
            if not wait_until(
                lambda: int(tq.redis.get(args.barrier_key) or 0) >= args.num_workers, 30.0
            ):
                say(error="barrier: the other workers never made their first claim")
                return EXIT_TIMEOUT
        if not uids:
            say(done=True)
            return EXIT_DONE
        time.sleep(rng.uniform(0, args.jitter_s))


def score_half_then_hang(args: argparse.Namespace) -> int:
    tq = connect(args.port)
    consumer = EventConsumer(
        tq,
        args.partition,
        group=args.group,
        reader=args.reader,
        wants=FINISHED_TRAJECTORIES,
        reclaim_idle_s=args.reclaim_idle_s,
    )
    events = []
    deadline = time.monotonic() + 30.0
    while len(events) < args.count:
        if time.monotonic() > deadline:
            say(error=f"read only {len(events)} of {args.count} events")
            return EXIT_TIMEOUT
        events += consumer.read(count=1000, block_s=0.2)
    first_half = events[: len(events) // 2]
    scored = tq.score_trajectories(args.partition, {e.key: reward(1.0) for e in first_half})
    say(
        event="scored-half",
        ids=[e.id for e in events],
        keys=[e.key for e in events],
        deliveries=[e.deliveries for e in events],
        scored=scored,
    )
    return hang(args.max_hang_s)


def consume_until_poison(args: argparse.Namespace) -> int:
    tq = connect(args.port)
    consumer = EventConsumer(
        tq,
        args.partition,
        group=args.group,
        reader=args.reader,
        wants=FINISHED_TRAJECTORIES,
        reclaim_idle_s=args.reclaim_idle_s,
        max_deliveries=args.max_deliveries,
    )
    deadline = time.monotonic() + 30.0
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        started = time.monotonic()
        events = consumer.read(count=100, block_s=0.1)
        if not events:
            # Done only after a read that began quiet_exit_s after the last event: by then any
            # entry left by a dead reader has been idle long enough to be reclaimed by it.
            if started - quiet_since > args.quiet_exit_s:
                say(done=True)
                return EXIT_DONE
            continue
        quiet_since = time.monotonic()
        good = [e for e in events if e.key != args.poison]
        if good:
            scored = tq.score_trajectories(args.partition, {e.key: reward(0.5) for e in good})
            consumer.ack(good)
            say(
                acked=[e.key for e in good],
                deliveries=[e.deliveries for e in good],
                scored=scored,
            )
        for event in events:
            if event.key == args.poison:
                say(poison=event.key, id=event.id, deliveries=event.deliveries)
                # Dies the way a reader crashing on a bad entry does: no ack, no cleanup.
                os._exit(EXIT_CRASHED)
    say(error="no quiet period before the deadline")
    return EXIT_TIMEOUT


def gateway_crash(args: argparse.Namespace) -> int:
    tq = connect(args.port)
    result = tq.claim_groups(
        args.partition, max_groups=1, claimer=args.claimer, lease_s=args.lease_s
    )
    if not result.claimed:
        say(error="nothing to claim")
        return EXIT_TIMEOUT
    claim = result.claimed[0]
    uid = claim.group.uid
    puts = [
        TrajectoryPut(make_trajectory(uid, index, args.claimer), claim.claim_id)
        for index in claim.missing_indices[: args.num_write]
    ]
    written = tq.put_trajectories(args.partition, puts).created
    say(
        event="wrote",
        uid=uid,
        claim_id=claim.claim_id,
        missing=claim.missing_indices,
        written=written,
    )
    return hang(args.max_hang_s)


ROLES: dict[str, Callable[[argparse.Namespace], int]] = {
    "claim-loop": claim_loop,
    "score-half-then-hang": score_half_then_hang,
    "consume-until-poison": consume_until_poison,
    "gateway-crash": gateway_crash,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roles = parser.add_subparsers(dest="role", required=True)

    def role(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = roles.add_parser(name, help=help_text)
        sub.add_argument("--port", type=int, required=True, help="redis-server port")
        sub.add_argument("--partition", default="train")
        sub.add_argument("--max-hang-s", type=float, default=120.0)
        return sub

    sub = role("claim-loop", "claim small random batches until nothing can be claimed")
    sub.add_argument("--claimer", required=True)
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--max-batch", type=int, default=5)
    sub.add_argument("--lease-s", type=float, default=60.0)
    sub.add_argument("--max-launched", type=int, default=None)
    sub.add_argument("--barrier-key", required=True)
    sub.add_argument("--num-workers", type=int, default=2)
    sub.add_argument("--jitter-s", type=float, default=0.001)

    sub = role("score-half-then-hang", "score half a batch of events, then hang without ack")
    sub.add_argument("--group", required=True)
    sub.add_argument("--reader", required=True)
    sub.add_argument("--count", type=int, required=True)
    sub.add_argument("--reclaim-idle-s", type=float, default=0.5)

    sub = role("consume-until-poison", "score and ack events; crash on the poison key")
    sub.add_argument("--group", required=True)
    sub.add_argument("--reader", required=True)
    sub.add_argument("--poison", required=True)
    sub.add_argument("--reclaim-idle-s", type=float, required=True)
    sub.add_argument("--max-deliveries", type=int, required=True)
    sub.add_argument("--quiet-exit-s", type=float, default=1.5)

    sub = role("gateway-crash", "claim one group, write some samples, then hang")
    sub.add_argument("--claimer", required=True)
    sub.add_argument("--lease-s", type=float, required=True)
    sub.add_argument("--num-write", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return ROLES[args.role](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
