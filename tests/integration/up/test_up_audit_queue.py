"""`relayrl audit` reads a stopped run's TransferQueue back from its AOF: every group, the leases
and where the reward consumer group stands in the event stream. A small queue built by hand on a
real redis-server (no `relayrl up`), then audited like a finished run."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import EventConsumer, TrajectoryPut, TransferQueue
from relayrl.tq.server import RedisServer
from relayrl.tq.testing import key_prefix_for_tests
from relayrl.up.audit import NAMESPACE, PARTITION, audit_run
from relayrl_testkit.helpers.up import audit_queue

FINISHED = {("trajectory", "finished")}


def trajectory(uid: str, index: int) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4],
        response_mask=b"\x01\x01",
        finish_reason="stop",
    )


def reward(score: float) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(score=score, status=common_pb2.REWARD_STATUS_OK)


class Run:
    """A run directory whose queue is filled through the TransferQueue's own transitions."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.server = RedisServer(run_dir / "redis")
        self.server.start()
        self.tq = TransferQueue(self.server.client(), namespace=NAMESPACE)
        self.tq.create_partition(PARTITION)

    def put(self, *uids: str) -> None:
        groups = [
            common_pb2.PromptGroup(uid=uid, num_samples=2, prompt_token_ids=[1, 2]) for uid in uids
        ]
        self.tq.put_groups(PARTITION, groups)

    def claim(self, uid: str) -> str:
        [claim] = self.tq.claim_named_groups(PARTITION, [uid], claimer="gw", lease_s=600).claimed
        return claim.claim_id

    def finish(self, uid: str) -> None:
        claim = self.claim(uid)
        puts = [TrajectoryPut(trajectory(uid, i), claim) for i in range(2)]
        self.tq.put_trajectories(PARTITION, puts)

    def score(self, uid: str, *scores: float) -> None:
        self.tq.score_trajectories(
            PARTITION, {f"{uid}_{i}": reward(s) for i, s in enumerate(scores)}
        )

    def drop_lease(self, uid: str) -> None:
        """A state no transition leaves behind: a running group whose lease is gone."""
        self.tq.redis.zrem(f"{key_prefix_for_tests(NAMESPACE, PARTITION)}leases", uid)

    def trained(self, steps: dict[int, list[str]]) -> None:
        (self.dir / "trainer").mkdir()
        lines = [
            json.dumps({"step": step, "uids": uids, "time": 0.0}) for step, uids in steps.items()
        ]
        (self.dir / "trainer" / "steps.jsonl").write_text("\n".join(lines) + "\n")

    def stop(self) -> None:
        self.tq.close()
        self.server.stop()


def test_the_audit_finds_what_the_queue_holds_and_what_no_one_will_move(tmp_path: Path) -> None:
    run = Run(tmp_path / "run")
    try:
        run.put("trained", "usable", "no-signal", "read-acked", "read-pending", "unread")
        run.put("running", "lease-lost", "pending")
        for uid, scores in (("trained", (1.0, 0.0)), ("usable", (1.0, 0.0))):
            run.finish(uid)
            run.score(uid, *scores)
        run.finish("no-signal")
        run.score("no-signal", 1.0, 1.0)
        assert sorted(run.tq.consume(PARTITION, 0, 3)) == ["no-signal", "trained", "usable"]
        reward = EventConsumer(run.tq, PARTITION, group="reward", reader="r", wants=FINISHED)
        run.finish("read-acked")
        reward.ack(reward.read(count=100, block_s=0.1))  # acknowledged and never scored
        run.finish("read-pending")
        assert {e.key for e in reward.read(count=100, block_s=0.1)} == {
            "read-pending_0",
            "read-pending_1",
        }  # delivered, not acknowledged: still the reward group's
        run.finish("unread")  # not delivered yet
        run.claim("running")
        run.claim("lease-lost")
        run.drop_lease("lease-lost")
        run.trained({0: ["trained", "ghost"]})
    finally:
        run.stop()

    report = audit_run(run.dir)
    assert dict(report.statuses) == {"consumed": 3, "finished": 3, "running": 2, "pending": 1}
    assert report.num_trained == 2 and report.trained_twice == []
    assert sorted(report.lost) == [
        "ghost: trained at step 0 but not in the TransferQueue",
        "lease-lost: running without a lease (nothing returns it to pending)",
        "read-acked_0: finished, never scored, and no event will deliver it",
        "read-acked_1: finished, never scored, and no event will deliver it",
        "usable: consumed at step 0 and usable there (fresh, with a signal), but no step trained "
        "it",
    ]
    assert report.left_over == 6  # 3 finished, 2 running, pending
    assert report.stale_served == [] and not report.ok

    seen = audit_queue(run.dir)  # the test kit's reading of the same queue
    assert list(seen.groups) == [  # in uid order
        *("lease-lost", "no-signal", "pending", "read-acked", "read-pending"),
        *("running", "trained", "unread", "usable"),
    ]
    assert seen.statuses["GROUP_STATUS_CONSUMED"] == 3
    assert seen.consumed_at() == {"trained": 0, "usable": 0, "no-signal": 0}
    assert seen.consume_events == {"trained": 1, "usable": 1, "no-signal": 1}


def test_without_a_reward_consumer_group_every_finished_trajectory_is_still_to_deliver(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path / "run")
    try:
        run.put("finished")
        run.finish("finished")
        run.trained({})
    finally:
        run.stop()

    report = audit_run(run.dir)
    assert dict(report.statuses) == {"finished": 1}
    assert report.lost == [] and report.ok


def test_every_issue_of_a_prompt_ends_trained_without_signal_skipped_or_in_play(
    tmp_path: Path,
) -> None:
    """The feeder's groups form chains (a re-issue names the group before it); the audit
    follows each to its end, and a group that could not be trained for a reason outside the
    policy with neither a re-issue nor a skip is a prompt lost."""
    run = Run(tmp_path / "run")
    groups = {  # uid: (prompt, the group it re-issues, re-issue number)
        "a0": ("1", "", 0), "a1": ("1", "a0", 1),  # failed, then trained
        "b0": ("2", "", 0), "b1": ("2", "b0", 1),  # dropped as stale, then skipped
        "c0": ("3", "", 0),  # failed: neither re-issued nor skipped
        "d0": ("4", "", 0),  # all scored the same: the policy's outcome
        "e0": ("5", "", 0),  # consumed by a step that never completed
        "f0": ("6", "", 0), "f1": ("6", "f0", 1),  # failed; its re-issue still pending
        "g0": ("7", "", 0), "g1": ("7", "g0", 1), "g2": ("7", "g0", 1),  # re-issued twice
        "other": ("", "", 0),  # not the feeder's
    }  # fmt: skip
    try:
        run.tq.put_groups(
            PARTITION,
            [
                common_pb2.PromptGroup(
                    uid=uid, num_samples=2, prompt_token_ids=[1, 2], prompt_key=key,
                    retry_of=retry_of, retry=retry,
                )
                for uid, (key, retry_of, retry) in groups.items()
            ],
        )  # fmt: skip

        def fail(uid: str) -> None:  # every rollout failed: scored at once
            claim = run.claim(uid)
            puts = [TrajectoryPut(trajectory(uid, i), claim, failed=True) for i in range(2)]
            run.tq.put_trajectories(PARTITION, puts)

        def scored(uid: str, *scores: float) -> None:
            run.finish(uid)
            run.score(uid, *scores)

        for uid in ("a0", "c0", "f0", "g0"):
            fail(uid)
        scored("d0", 1.0, 1.0)
        assert sorted(run.tq.consume(PARTITION, 0, 5)) == ["a0", "c0", "d0", "f0", "g0"]
        scored("b0", 1.0, 0.0)
        run.tq.drop_groups(PARTITION, ["b0"], "stale at step 1")
        fail("b1")
        for uid in ("a1", "g1", "g2"):
            scored(uid, 1.0, 0.0)
        assert sorted(run.tq.consume(PARTITION, 1, 4)) == ["a1", "b1", "g1", "g2"]
        scored("e0", 1.0, 0.0)
        assert run.tq.consume(PARTITION, 2, 1) == ["e0"]
        scored("other", 1.0, 0.0)
        skipped = {"prompt": 2, "uid": "b1", "retries": 1, "cause": "no_valid", "reason": "x"}
        records = [
            {"step": 0, "time": 0.0, "uids": []},
            {"step": 1, "time": 1.0, "uids": ["a1", "g1", "g2"], "skipped": [skipped]},
        ]
        (run.dir / "trainer").mkdir()
        (run.dir / "trainer" / "steps.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    finally:
        run.stop()

    report = audit_run(run.dir)
    assert report.prompts == {
        "trained": 2, "skipped": 1, "lost": 1, "without_signal": 1, "in_play": 2,
    }  # fmt: skip
    assert report.num_retries == 5
    assert report.prompts_lost == [
        "c0: prompt 3, no_valid, neither re-issued nor recorded as skipped"
    ]
    assert report.trained_twice == ["g0: its prompt re-issued 2 times ['g1', 'g2']"]
    assert report.lost == [] and not report.ok
    assert report.summary().endswith(
        "; prompts issued=7 retried=5 prompts_skipped=1 prompts_lost=1"
    )
