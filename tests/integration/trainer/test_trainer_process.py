"""relayrl-trainer as a real process: real megatron-core on CPU, a real redis-server, real
gRPC; rollout and reward played by `RolloutEmulator` against the same TransferQueue.

The crash test is the trainer's exactly-once promise: SIGKILL mid-run, restart from the last
checkpoint, and every prompt group is trained at exactly one step of the final history."""

from __future__ import annotations

import time

import grpc
import pytest

from relayrl.core.service_process import ServiceProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from relayrl.tq import GroupStatus, TransferQueue
from relayrl_testkit.helpers.trainer import (
    RolloutEmulator,
    steps_logged,
    trainer_config,
    wait_exit,
)

pytestmark = pytest.mark.slow


def processes_in_group(pgid: int, wait_s: float = 10.0) -> list[int]:
    """Live (non-zombie) processes of a process group, after giving SIGKILL time to land."""
    import os

    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def consumed_steps(tq: TransferQueue) -> dict[str, int]:
    uids = tq.group_uids("train", GroupStatus.CONSUMED)
    groups = tq.get_groups("train", uids, with_trajectories=False)
    return {g.group.uid: g.group.tags.consumed_step for g in groups}


def test_trains_reports_status_and_stops_on_request(redis_server, tq, model_dir, tmp_path) -> None:
    config = trainer_config(
        redis_server, model_dir, tmp_path, total_steps=1000, checkpoint={"interval_steps": 10_000}
    )
    emulator = RolloutEmulator(tq).start()
    trainer = ServiceProcess("relayrl-trainer", config, tmp_path / "t").start(timeout_s=120)
    try:
        channel = grpc.insecure_channel(trainer.target)
        stub = trainer_pb2_grpc.TrainerStub(channel)
        deadline = time.monotonic() + 120
        status = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        while status.step < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            status = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        assert status.step >= 2, trainer.log()
        assert status.mode == "sync" and status.world_size == 1
        assert status.published_version.version == status.step
        assert "reward_mean" in status.metrics and "grad_norm" in status.metrics
        saved = stub.Control(
            trainer_pb2.ControlRequest(action=trainer_pb2.CONTROL_ACTION_CHECKPOINT), timeout=60
        )
        assert saved.checkpoint_step >= status.step - 1  # the last completed step, or later
        assert list((tmp_path / "ckpt").glob("step-*"))  # only this request saves here
        stub.Control(trainer_pb2.ControlRequest(action=trainer_pb2.CONTROL_ACTION_STOP), timeout=10)
        assert wait_exit(trainer, 120) == 0, trainer.log()
    finally:
        emulator.stop()
        trainer.stop()
    records = steps_logged(tmp_path / "steps.jsonl")
    assert records, trainer.log()
    first = records[0]
    for key in ("kl", "k3_kl", "chi2_token", "abs_log_ratio_p99", "is_ess", "grad_norm", "lr"):
        assert getattr(first, key) is not None, first
    assert first.staleness_histogram == {1: 2}  # sync: issued and trained at one step
    # The rollout emulator samples every trajectory with version 0: at step s the lag is s.
    assert [r.policy_lag_max for r in records] == [r.step for r in records]
    assert all(r.groups["keep"] == 2 for r in records)
    assert all(r.emulated_update is None for r in records)


def test_emulated_update_sleeps_publishes_and_says_so(
    redis_server, tq, model_dir, tmp_path
) -> None:
    """The benchmark-only update trains nothing, says so in every record and log, and still
    runs the rest of the step: sampling, publishing a version per step, checkpoints."""
    config = trainer_config(
        redis_server, model_dir, tmp_path, total_steps=3, research={"emulated_update_s": 0.2}
    )
    config["publish"] = {"type": "hf_dir", "dir": str(tmp_path / "published"), "keep": 5}
    emulator = RolloutEmulator(tq).start()
    trainer = ServiceProcess("relayrl-trainer", config, tmp_path / "t").start(timeout_s=120)
    try:
        assert wait_exit(trainer, 180) == 0, trainer.log()
    finally:
        emulator.stop()
        trainer.stop()
    records = steps_logged(tmp_path / "steps.jsonl")
    assert [r.step for r in records] == [0, 1, 2]
    for record in records:
        assert record.emulated_update == 1.0
        assert record.trained_rows == 8.0  # 2 groups x 4 samples
        assert record.grad_norm is None and record.kl is None  # no model step ran
    assert sorted(p.name for p in (tmp_path / "published").iterdir()) == ["v1", "v2", "v3"]
    assert "the policy update is a sleep (benchmark only)" in trainer.log()


def test_sigkill_then_resume_trains_every_group_exactly_once(
    redis_server, tq, model_dir, tmp_path
) -> None:
    config = trainer_config(redis_server, model_dir, tmp_path, total_steps=6)
    log = tmp_path / "steps.jsonl"
    emulator = RolloutEmulator(tq).start()
    try:
        first = ServiceProcess("relayrl-trainer", config, tmp_path / "a").start(timeout_s=120)
        deadline = time.monotonic() + 120
        while len(steps_logged(log)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        first.kill()  # SIGKILL: no checkpoint-on-exit, possibly mid-step or mid-save
        assert not processes_in_group(first.pid)  # checkpoint writers went with it
        killed_at = len(steps_logged(log))
        assert killed_at >= 3, first.log()
        second = ServiceProcess("relayrl-trainer", config, tmp_path / "b").start(timeout_s=120)
        assert wait_exit(second, 180) == 0, second.log()
        second.stop()
    finally:
        emulator.stop()
    # The restart continued from a checkpoint (it did not start over): at most the step that
    # was running when the kill came (or whose checkpoint it interrupted) is done again.
    assert "resumed from" in second.log()
    assert len(steps_logged(log)) <= 6 + 1
    # The final history: for each step, the last record written (a step re-run after the
    # crash overwrites the attempt the checkpoint did not keep).
    history: dict[int, list[str]] = {}
    for record in steps_logged(log):
        history[record.step] = record.uids
    assert sorted(history) == list(range(6))
    trained = [uid for uids in history.values() for uid in uids]
    assert len(trained) == len(set(trained)) == 12  # none twice
    consumed = consumed_steps(tq)
    for step, uids in history.items():
        for uid in uids:
            assert consumed[uid] == step  # the queue agrees on which step took it
    # nothing consumed that no step trained (DAPO keeps all: every group has signal)
    assert set(consumed) == set(trained)
    groups = tq.get_groups("train", trained, with_trajectories=False)
    assert {g.group.tags.status for g in groups} == {common_pb2.GROUP_STATUS_CONSUMED}


def test_unreadable_prompts_fail_at_start_with_one_line(redis_server, model_dir, tmp_path) -> None:
    config = trainer_config(redis_server, model_dir, tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    trainer = ServiceProcess("relayrl-trainer", config, tmp_path / "t")
    with pytest.raises(RuntimeError, match="exited 1"):  # never becomes ready
        trainer.start(timeout_s=60)
    assert trainer.process is not None and trainer.process.wait(timeout=30) == 1
    assert "prompts.jsonl:1: unknown keys ['answer']" in trainer.log()
    assert "Traceback" not in trainer.log()


def test_data_parallel_two_starts_its_second_rank_and_leaves_nothing_behind(
    redis_server, tq, model_dir, tmp_path
) -> None:
    import psutil

    config = trainer_config(
        redis_server,
        model_dir,
        tmp_path,
        total_steps=2,
        model={"hf_dir": str(model_dir), "data_parallel": 2},
    )
    emulator = RolloutEmulator(tq).start()
    try:
        trainer = ServiceProcess("relayrl-trainer", config, tmp_path / "t").start(timeout_s=120)
        children = psutil.Process(trainer.pid).children(recursive=True)
        assert len(children) == 1  # rank 1, started and tracked by rank 0
        assert wait_exit(trainer, 120) == 0, trainer.log()
    finally:
        emulator.stop()
    psutil.wait_procs(children, timeout=10)
    assert not any(c.is_running() for c in children)
    assert len(steps_logged(tmp_path / "steps.jsonl")) == 2


def test_a_trainer_whose_every_rollout_fails_exits_3_with_the_cause(
    redis_server, tq, model_dir, tmp_path
) -> None:
    """The infrastructure stop rule, in the real process: a restart would wait for the same
    thing, so the exit code (3) tells a supervisor not to restart it."""
    progress = {"infra_window": 24, "infra_grace_s": 2, "report_interval_s": 1}
    progress["log"] = str(tmp_path / "progress.jsonl")
    config = trainer_config(redis_server, model_dir, tmp_path, progress=progress)
    emulator = RolloutEmulator(tq, reward=lambda uid, i, response: None).start()
    trainer = ServiceProcess("relayrl-trainer", config, tmp_path / "t").start(timeout_s=120)
    try:
        assert wait_exit(trainer, 120) == 3, trainer.log()
    finally:
        emulator.stop()
        trainer.stop()
    from relayrl.trainer.progress import ProgressLog

    records = ProgressLog(tmp_path / "progress.jsonl").read_all()
    assert records[-1].kind == "stopped"
    assert records[-1].cause.startswith("24 of the last 24 rollouts failed as infrastructure")
    assert "rollout failed (no reason given)" in records[-1].cause
    assert any(r.kind == "waiting" and r.failed_rollouts for r in records[:-1])
    assert records[-1].line() in trainer.log()
    assert steps_logged(tmp_path / "steps.jsonl") == []
