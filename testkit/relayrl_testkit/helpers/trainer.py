"""For trainer tests: pushing prompt groups through a real TransferQueue to `scored`, as the
gateway and the reward-service would, so that the tests start from the state the trainer
consumes; and relayrl-trainer's config, step log and exit for a trainer run as a process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from relayrl.core.records import StepRecord, read_records
from relayrl.core.service_process import ServiceProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.model import GroupWithTrajectories, TrajectoryPut
from relayrl.tq.server import RedisServer

PROMPT = [1, 5, 6, 7]


def put_group(tq: TransferQueue, uid: str, *, n: int, prompt_step: int, partition: str = "train"):
    tq.put_groups(
        partition,
        [
            common_pb2.PromptGroup(
                uid=uid,
                prompt_step=prompt_step,
                num_samples=n,
                prompt_token_ids=PROMPT,
                data_source="arith",
                ground_truth="1",
            )
        ],
    )


def claim(tq: TransferQueue, uid: str, partition: str = "train") -> str:
    """Claims pending groups until `uid` is among them; returns its claim id (the others stay
    claimed by this test's claimer, like groups in flight)."""
    for _ in range(1000):
        result = tq.claim_groups(partition, max_groups=1, claimer="test", lease_s=600)
        for claimed in result.claimed:
            if claimed.group.uid == uid:
                return claimed.claim_id
        if not result.claimed:
            break
    raise AssertionError(f"group {uid} was not claimable")


def trajectory(uid: str, index: int, response: Sequence[int], logp: float = -1.0):
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=PROMPT,
        response_token_ids=list(response),
        response_mask=bytes([1] * len(response)),
        rollout_logprobs=[logp] * len(response),
        spans=[
            common_pb2.GenerationSpan(start=0, end=len(response), policy_version=0, generated=True)
        ],
        finish_reason="stop",
    )


def judged_group(
    rewards: Sequence[float | None], *, prompt_step: int = 0, error: str = "agent exited 1: boom"
) -> GroupWithTrajectories:
    """A consumed group as the trainer judges it, built in memory (no queue): member i scored
    rewards[i]; None failed as infrastructure with `error`."""
    trajectories = []
    for i, reward in enumerate(rewards):
        t = common_pb2.Trajectory(uid="g", index=i)
        if reward is None:
            t.tags.is_infra = True
            t.tags.status = common_pb2.TRAJECTORY_STATUS_FAILED
            t.error = error
        else:
            t.tags.status = common_pb2.TRAJECTORY_STATUS_SCORED
            t.reward.status = common_pb2.REWARD_STATUS_OK
            t.reward.score = reward
        trajectories.append(t)
    group = common_pb2.PromptGroup(uid="g")
    group.tags.prompt_step = prompt_step
    return GroupWithTrajectories(group, trajectories)


def scored_group(
    tq: TransferQueue,
    uid: str,
    rewards: Sequence[float | None],
    *,
    prompt_step: int = 0,
    partition: str = "train",
    response: Sequence[int] = (9, 10, 2),
) -> None:
    """A group whose member i scored rewards[i]; None marks an infrastructure failure."""
    put_group(tq, uid, n=len(rewards), prompt_step=prompt_step, partition=partition)
    claim_id = claim(tq, uid, partition)
    puts = [
        TrajectoryPut(trajectory(uid, i, response), claim_id, failed=reward is None)
        for i, reward in enumerate(rewards)
    ]
    tq.put_trajectories(partition, puts)
    scores = {
        f"{uid}_{i}": common_pb2.RewardResult(
            item_id=f"{uid}_{i}", status=common_pb2.REWARD_STATUS_OK, score=reward
        )
        for i, reward in enumerate(rewards)
        if reward is not None
    }
    if scores:
        tq.score_trajectories(partition, scores)


class RolloutEmulator:
    """Stands in for the gateway and the reward-service in trainer tests (the real ones are
    exercised end to end in the main-job tests): claims pending groups, writes trajectories of
    random tokens with rollout log-probs, and scores them, member `i` of every group with
    reward `i % 2` (so every group has signal) unless `reward` says otherwise. Runs in a
    thread; `stop()` joins it."""

    def __init__(
        self,
        tq: TransferQueue,
        partition: str = "train",
        *,
        seed: int = 0,
        vocab: int = 500,
        reward=None,  # (uid, index, response) -> float | None (None: infra failure)
    ) -> None:
        import random
        import threading

        self._tq = tq
        self._partition = partition
        self._rng = random.Random(seed)
        self._vocab = vocab
        self._reward = reward or (lambda uid, i, response: float(i % 2))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.num_groups = 0

    def start(self) -> RolloutEmulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            result = self._tq.claim_groups(
                self._partition, max_groups=4, claimer="emulator", lease_s=600
            )
            if not result.claimed:
                self._stop.wait(0.05)
                continue
            for claimed in result.claimed:
                self._roll_out(claimed)

    def _roll_out(self, claimed) -> None:
        group = claimed.group
        puts, scores = [], {}
        for i in claimed.missing_indices:
            response = [self._rng.randrange(3, self._vocab) for _ in range(self._rng.randint(2, 8))]
            response.append(2)  # <|im_end|>
            reward = self._reward(group.uid, i, response)
            t = trajectory(group.uid, i, response, logp=-3.0)
            puts.append(TrajectoryPut(t, claimed.claim_id, failed=reward is None))
            if reward is not None:
                scores[f"{group.uid}_{i}"] = common_pb2.RewardResult(
                    item_id=f"{group.uid}_{i}", status=common_pb2.REWARD_STATUS_OK, score=reward
                )
        self._tq.put_trajectories(self._partition, puts)
        if scores:
            self._tq.score_trajectories(self._partition, scores)
        self.num_groups += 1


def write_prompts(path: Path, n: int = 12) -> Path:
    lines = [
        json.dumps({"prompt": f"{i} + 2 =", "ground_truth": str(i + 2), "data_source": "arith"})
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def trainer_config(redis: RedisServer, model_dir: Path, tmp_path: Path, **over) -> dict:
    config = {
        "tq": {"url": redis.url},
        "model": {"hf_dir": str(model_dir)},
        "optim": {"lr": 1e-4},
        "rollout_shape": {"batch_groups": 2, "samples_per_prompt": 4, "max_tokens": 64},
        "algorithm": {"micro_batch_size": 4},
        "data": {
            "prompts_file": str(write_prompts(tmp_path / "prompts.jsonl")),
            "poll_interval_s": 0.05,
        },
        "progress": {"stall_min_s": 120},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval_steps": 1, "keep": 2},
        "metrics_log": str(tmp_path / "steps.jsonl"),
        "total_steps": 4,
    }
    for section, values in over.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    return config


def steps_logged(path: Path) -> list[StepRecord]:
    """The trainer's step log so far (a line still being written is not there yet)."""
    return read_records(path, StepRecord)


def wait_exit(trainer: ServiceProcess, timeout_s: float) -> int:
    assert trainer.process is not None
    return trainer.process.wait(timeout=timeout_s)
