"""The TransferQueue path: relayrl-reward scores trajectories as they are written, and a
reward process SIGKILLed mid-stream loses nothing and scores nothing twice in effect."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TrajectoryPut, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.reward import RewardProcess

P = "train"
NUM_GROUPS, NUM_SAMPLES = 30, 2


def reward_config(redis_url: str, sleep_s: float) -> dict:
    return {
        "tq": {"url": redis_url, "partitions": [P]},
        "managers": {
            "rules": {"type": "naive"},
            "by_id": {"type": "custom", "path": "relayrl_testkit.helpers.reward_plugins:by_id"},
            "env": {"type": "env"},
        },
        "default_manager": "rules",
        "tq_scorer": {
            "enabled": True,
            "partitions": [P],
            "reader": "reward-0",  # a pod name: stable across restarts
            "reclaim_idle_s": 0.5,
            "read_count": 4,
            "managers_by_data_source": {"slow": "by_id", "env": "env"},
        },
        "pipeline": {"num_workers": 2},
    }


def group(uid: str, data_source: str = "gsm8k", **labels: str) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid,
        num_samples=NUM_SAMPLES,
        prompt_token_ids=[1, 2],
        messages=[common_pb2.ChatMessage(role="user", content="What is 1+1?")],
        data_source=data_source,
        ground_truth="#### 2",
        labels={"sleep_s": "0.05", **labels},
    )


def trajectory(uid: str, index: int, answer: str) -> common_pb2.Trajectory:
    traj = common_pb2.Trajectory(
        uid=uid,
        index=index,
        response_token_ids=[5, 6, 7],
        response_text=f"thinking... #### {answer}",
    )
    traj.response_mask = b"\x01\x01\x01"
    return traj


def write_rollouts(tq: TransferQueue, uids: list[str], pause_s: float) -> None:
    claimed = tq.claim_groups(P, max_groups=len(uids), claimer="gw", lease_s=600).claimed
    for claim in claimed:
        puts = [
            TrajectoryPut(trajectory(claim.group.uid, i, "2" if i == 0 else "3"), claim.claim_id)
            for i in range(NUM_SAMPLES)
        ]
        tq.put_trajectories(P, puts)
        time.sleep(pause_s)


def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def scored_transitions(tq: TransferQueue) -> Counter[str]:
    return Counter(
        e.key
        for e in tq.read_events(P, count=100_000)
        if e.kind == "trajectory" and e.to_status == "scored"
    )


def test_trajectories_are_scored_as_they_land_with_rule_rewards(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    service = RewardProcess(tmp_path / "r", reward_config(redis_server.url, 0)).start()
    try:
        tq.put_groups(P, [group("g0"), group("g1", data_source="no_such_source")])
        write_rollouts(tq, ["g0", "g1"], pause_s=0)
        wait_until(lambda: len(scored_transitions(tq)) == 4, 30, "4 scored trajectories")
        (g0, g1) = tq.get_groups(P, ["g0", "g1"])
        rewards = {f"{t.uid}_{t.index}": t.reward for t in g0.trajectories + g1.trajectories}
        assert rewards["g0_0"].status == common_pb2.REWARD_STATUS_OK
        assert rewards["g0_0"].score == 1.0
        assert rewards["g0_1"].status == common_pb2.REWARD_STATUS_POLICY_FAIL
        # An unscorable trajectory is stored with its status, never as a reward of 0.
        assert rewards["g1_0"].status == common_pb2.REWARD_STATUS_INVALID_INPUT
        assert "no_such_source" in rewards["g1_0"].message
        assert g0.group.tags.status == common_pb2.GROUP_STATUS_SCORED
    finally:
        service.kill()


def test_the_env_manager_scores_the_trajectorys_env_reward_field_and_never_its_labels(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    service = RewardProcess(tmp_path / "r", reward_config(redis_server.url, 0)).start()
    try:
        posing = {"env_reward": "1.0", "env_reward_status": "ok"}
        tq.put_groups(P, [group("e0", "env", **posing), group("e1", "env")])
        reported = {
            "e0_0": common_pb2.EnvReward(status=common_pb2.ENV_REWARD_STATUS_FAIL, score=0.25),
            # malformed (no status): refused and stored as such, never a reward
            "e1_0": common_pb2.EnvReward(score=1.0),
        }
        for claim in tq.claim_groups(P, max_groups=2, claimer="gw", lease_s=600).claimed:
            puts = []
            for i in range(NUM_SAMPLES):
                traj = trajectory(claim.group.uid, i, "2")
                traj.labels.update(posing)  # labels of the reward's old names are only labels
                if (key := f"{claim.group.uid}_{i}") in reported:
                    traj.env_reward.CopyFrom(reported[key])
                puts.append(TrajectoryPut(traj, claim.claim_id))
            tq.put_trajectories(P, puts)
        wait_until(lambda: len(scored_transitions(tq)) == 4, 30, "4 scored trajectories")
        groups = tq.get_groups(P, ["e0", "e1"])
        rewards = {f"{t.uid}_{t.index}": t.reward for g in groups for t in g.trajectories}
        assert (rewards["e0_0"].status, rewards["e0_0"].score) == (
            common_pb2.REWARD_STATUS_POLICY_FAIL,
            0.25,
        )
        invalid = common_pb2.REWARD_STATUS_INVALID_INPUT
        for key, words in (
            ("e0_1", "reports no environment reward"),
            ("e1_0", "malformed environment reward"),
            ("e1_1", "reports no environment reward"),
        ):
            assert rewards[key].status == invalid and words in rewards[key].message, rewards[key]
            assert rewards[key].manager == "env", rewards[key]
    finally:
        service.kill()


def test_sigkill_mid_stream_loses_nothing_and_scores_nothing_twice(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    tq = TransferQueue(redis_server.client())
    tq.create_partition(P)
    uids = [f"g{k}" for k in range(NUM_GROUPS)]
    tq.put_groups(P, [group(uid, data_source="slow") for uid in uids])
    config = reward_config(redis_server.url, 0.05)
    first = RewardProcess(tmp_path / "first", config).start()
    writer = threading.Thread(target=write_rollouts, args=(tq, uids, 0.03))
    writer.start()
    try:
        wait_until(lambda: len(scored_transitions(tq)) >= 10, 60, "some scored trajectories")
        first.kill()  # SIGKILL, mid-stream: some events read and not yet acknowledged
        killed_at = len(scored_transitions(tq))
        assert killed_at < NUM_GROUPS * NUM_SAMPLES
        second = RewardProcess(tmp_path / "second", config).start()
        try:
            writer.join(60)
            total = NUM_GROUPS * NUM_SAMPLES
            wait_until(lambda: len(scored_transitions(tq)) == total, 90, "every trajectory")
        finally:
            second.kill()
    finally:
        first.kill()
        writer.join(60)
    transitions = scored_transitions(tq)
    assert set(transitions) == {f"{u}_{i}" for u in uids for i in range(NUM_SAMPLES)}
    assert set(transitions.values()) == {1}  # each trajectory scored exactly once in effect
    counts = tq.counts(P)
    assert counts.trajectories.get("scored") == NUM_GROUPS * NUM_SAMPLES
    assert counts.groups.get("scored") == NUM_GROUPS


def test_the_service_starts_before_redis_and_scores_once_it_is_up(tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path / "redis")  # port chosen, nothing listening yet
    service = RewardProcess(tmp_path / "r", reward_config(redis_server.url, 0)).start()
    try:
        time.sleep(1.0)  # the TransferQueue reader is retrying; gRPC already serves
        assert service.alive()
        redis_server.start()
        tq = TransferQueue(redis_server.client())
        tq.create_partition(P)
        tq.put_groups(P, [group("g0")])
        write_rollouts(tq, ["g0"], pause_s=0)
        wait_until(lambda: len(scored_transitions(tq)) == NUM_SAMPLES, 30, "scored trajectories")
        tq.close()
    finally:
        service.kill()
        redis_server.kill()


def test_a_redis_restart_mid_batch_is_waited_out_in_place_not_by_a_reclaim(
    tmp_path: Path,
) -> None:
    """Redis goes away while a batch is being scored and comes back a few seconds later: the
    reader stores the scores and acknowledges them on the new connection as soon as it
    answers, instead of leaving them pending for a reclaim (reclaim_idle_s: a minute here)."""
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    config = reward_config(redis_server.url, 0)
    config["tq_scorer"]["reclaim_idle_s"] = 60.0
    service = RewardProcess(tmp_path / "r", config).start()
    tq = TransferQueue(redis_server.client())
    try:
        tq.create_partition(P)
        uids = ["g0", "g1"]
        tq.put_groups(P, [group(uid, data_source="slow", sleep_s="2.0") for uid in uids])
        write_rollouts(tq, uids, pause_s=0)

        def being_scored() -> int:
            return sum(len(g.pending) for g in tq.consumer_groups(P).values())

        wait_until(lambda: being_scored() == len(uids) * NUM_SAMPLES, 30, "the batch read")
        redis_server.stop()  # a clean stop: its AOF keeps every write
        time.sleep(3.0)  # the scores are ready meanwhile and cannot be stored
        redis_server.start()
        total = len(uids) * NUM_SAMPLES
        wait_until(lambda: len(scored_transitions(tq)) == total, 30, "every score stored")
        wait_until(lambda: being_scored() == 0, 30, "every event acknowledged")
        assert set(scored_transitions(tq).values()) == {1}
        assert "will be redelivered" not in service.log_path.read_text()
    finally:
        tq.close()
        service.kill()
        redis_server.kill()
