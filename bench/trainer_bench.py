"""Where a trainer step's time goes: real relayrl-trainer process (megatron-core on CPU, the tiny
model), fed from a real TransferQueue on a private redis-server.

Before the clock starts, `--steps` x `--groups` prompt groups of `--samples` trajectories
(`--response-tokens` random tokens each, rewards with signal) are written and scored, so the
trainer never waits for rollout: what it spends outside the model is its own overhead.

Per step the trainer logs its phases (JSONL): `wait` (staleness gate, consume, read and decode
the groups), `old_logprobs` (pi_old forward pass), `update` (the k local updates) and `model`,
the time inside megatron's forward, backward (with the loss) and optimizer step. The first
`--warmup` steps are not counted.

    overhead = sum(step - model) / sum(step)     over the counted steps

The last line is exactly: trainer-bench: overhead=<fraction of step time outside model
forward/backward/optimizer>
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

from relayrl.core.records import StepRecord, read_records
from relayrl.core.service_process import ServiceProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.model import TrajectoryPut
from relayrl.tq.server import RedisServer

PARTITION = "train"


def prefill(tq: TransferQueue, args: argparse.Namespace) -> int:
    rng = random.Random(0)
    num_groups = (args.steps + args.warmup) * args.groups
    prompt = [1, *(rng.randrange(3, 500) for _ in range(args.prompt_tokens)), 2]
    tq.put_groups(
        PARTITION,
        [
            common_pb2.PromptGroup(
                uid=f"b{g}",
                num_samples=args.samples,
                prompt_token_ids=prompt,
                prompt_step=g // args.groups,  # issued for the step that trains it (sync)
            )
            for g in range(num_groups)
        ],
    )
    claimed = tq.claim_groups(PARTITION, max_groups=num_groups, claimer="bench", lease_s=3600)
    for c in claimed.claimed:
        uid = c.group.uid
        puts = []
        for i in range(args.samples):
            response = [rng.randrange(3, 500) for _ in range(args.response_tokens - 1)] + [2]
            trajectory = common_pb2.Trajectory(
                uid=uid,
                index=i,
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_mask=bytes([1] * len(response)),
                rollout_logprobs=[-6.2] * len(response),
                spans=[
                    common_pb2.GenerationSpan(
                        start=0, end=len(response), policy_version=0, generated=True
                    )
                ],
                finish_reason="stop",
            )
            puts.append(TrajectoryPut(trajectory, c.claim_id))
        tq.put_trajectories(PARTITION, puts)
        tq.score_trajectories(
            PARTITION,
            {
                f"{uid}_{i}": common_pb2.RewardResult(
                    item_id=f"{uid}_{i}", status=common_pb2.REWARD_STATUS_OK, score=float(i % 2)
                )
                for i in range(args.samples)
            },
        )
    return num_groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="counted steps")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted first steps")
    parser.add_argument("--groups", type=int, default=8, help="prompt groups per step")
    parser.add_argument("--samples", type=int, default=8, help="trajectories per group")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=96)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--model", type=Path, help="HF folder (default: build the tiny model)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from relayrl.models.tiny import TinyModelConfig, init_model

            model = work / "model"
            init_model(model, TinyModelConfig())
        with RedisServer(work / "redis") as redis_server:
            tq = TransferQueue(redis_server.client())
            tq.create_partition(PARTITION)
            num_groups = prefill(tq, args)
            log = work / "steps.jsonl"
            config = {
                "tq": {"url": redis_server.url},
                "model": {"hf_dir": str(model)},
                "rollout_shape": {"batch_groups": args.groups},
                "algorithm": {"micro_batch_size": args.micro_batch_size},
                "progress": {"stall_min_s": 60},
                "metrics_log": str(log),
                "total_steps": args.steps + args.warmup,
            }
            trainer = ServiceProcess("relayrl-trainer", config, work / "trainer")
            trainer.start(timeout_s=180)
            assert trainer.process is not None
            code = trainer.process.wait(timeout=3600)
            if code != 0:
                print(trainer.log()[-3000:], file=sys.stderr)
                return 1
            consumed = tq.counts(PARTITION).groups
        records = read_records(log, StepRecord)
    counted = records[args.warmup :]
    rows = []
    for r in counted:
        phases = r.phases_s
        step_s = r.step_duration_s
        rows.append(
            {
                "step": step_s,
                "wait": phases.get("wait", 0.0),
                "old_logprobs": phases.get("old_logprobs", 0.0),
                "update": phases.get("update", 0.0),
                "model": phases.get("model", 0.0),
                "publish": phases.get("publish", 0.0),
            }
        )
    print(
        f"{num_groups} groups x {args.samples} samples, {args.response_tokens} response tokens; "
        f"{len(counted)} counted steps of {args.groups} groups; consumed: "
        f"{consumed.get('consumed', 0)}"
    )
    print(f"{'phase':<14}{'mean s':>10}{'share':>9}")
    total = sum(r["step"] for r in rows)
    for phase in ("step", "wait", "old_logprobs", "update", "model", "publish"):
        mean = statistics.fmean(r[phase] for r in rows)
        share = sum(r[phase] for r in rows) / total
        print(f"{phase:<14}{mean:>10.3f}{share:>9.1%}")
    tokens = statistics.fmean(r.trained_tokens or 0.0 for r in counted)
    print(f"trained tokens per step: {tokens:.0f}")
    overhead = sum(r["step"] - r["model"] for r in rows) / total
    print(f"trainer-bench: overhead={overhead:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
