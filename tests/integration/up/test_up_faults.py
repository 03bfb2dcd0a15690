"""Crashes during a `relayrl up` run: the reward-service, then the gateway, then the trainer
are SIGKILLed (with their process groups) while training. The supervisor restarts each, the
run completes, and the TransferQueue shows that nothing was lost or trained twice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from up_helpers import (
    SHORT_RUN,
    UpProcess,
    audit_queue,
    check_exactly_once,
    deep_update,
    kill_group,
    processes_of,
    stack_state,
    steps_logged,
    wait_for_steps,
)

from relayrl.proto.common.v1 import common_pb2

STEPS = 8


def crash(up: UpProcess, name: str, timeout_s: float = 300) -> None:
    """SIGKILL `name` and wait until the supervisor has it running again."""
    before = stack_state(up.run_dir)["children"][name]
    kill_group(before["pid"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.process.poll() is not None:
            raise AssertionError(f"relayrl up exited after {name} was killed:\n{up.output()}")
        now = stack_state(up.run_dir)["children"][name]
        if now["restarts"] > before["restarts"] and now["pid"] != before["pid"]:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} not restarted in {timeout_s} s:\n{up.output()}")


@pytest.mark.timeout(1200)
def test_killed_services_are_restarted_and_nothing_is_lost_or_trained_twice(
    tmp_path: Path,
) -> None:
    # a checkpoint every 3 steps: the resumed trainer must hand back what it consumed after one
    config = deep_update(
        SHORT_RUN,
        {"train": {"steps": STEPS, "checkpoint_interval_steps": 3}, "eval": {"interval_steps": 0}},
    )
    up = UpProcess.start(tmp_path / "runs", config, "--mode", "separate_async")
    try:
        wait_for_steps(up, 2, 600)
        crash(up, "reward")
        wait_for_steps(up, 4, 600)
        crash(up, "gateway")
        wait_for_steps(up, 6, 600)
        crash(up, "trainer")
        assert up.wait(900) == 0, up.output()
        run_dir = up.run_dir
    finally:
        up.stop()

    events = [json.loads(x) for x in (run_dir / "logs/supervisor.jsonl").read_text().splitlines()]
    restarted = [e["child"] for e in events if e["kind"] == "restarted"]
    assert restarted == ["reward", "gateway", "trainer"], events
    assert f"trained arith for {STEPS} steps" in up.output()

    steps = {r["step"] for r in steps_logged(run_dir)}
    assert steps == set(range(STEPS))
    audit = audit_queue(run_dir)
    check_exactly_once(run_dir, audit)
    assert audit.infra_trajectories() == []
    # every consumed group went through the reward-service: scored, never left unscored
    scored = common_pb2.TRAJECTORY_STATUS_SCORED
    rewarded = {common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_POLICY_FAIL}
    for uid in audit.consumed_at():
        group = audit.groups[uid]
        assert len(group.trajectories) == group.group.num_samples
        assert {t.tags.status for t in group.trajectories} == {scored}, uid
        assert {t.reward.status for t in group.trajectories} <= rewarded, uid
    # the resumed trainer went back to its checkpoint and republished its weights
    assert "republished version" in (run_dir / "logs" / "trainer.log").read_text()
    committed = [
        json.loads(x)
        for x in (run_dir / "weightsync/transfers.jsonl").read_text().splitlines()
        if json.loads(x)["state"] == "committed"
    ]
    assert committed[-1]["version"] == STEPS
    assert processes_of(run_dir) == []
