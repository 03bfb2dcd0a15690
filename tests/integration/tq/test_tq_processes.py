"""The TransferQueue under real concurrency and real crashes: worker processes
(relayrl_testkit.helpers.tq_workers) claim, score and die (SIGKILL, by PID) against a private
redis-server, and the queue keeps its promises: no group claimed twice, the launched cap holds
across claimers, a dead reader's entries are redelivered and processed once in effect, poison
entries are dead-lettered, and an expired lease hands the rest of a group to a new claimer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    EventConsumer,
    GroupStatus,
    StaleClaimError,
    TrajectoryPut,
    TrajectoryStatus,
    TransferQueue,
)
from relayrl.tq.server import RedisServer

P = "train"
WORKERS = "relayrl_testkit.helpers.tq_workers"
FINISHED_TRAJECTORIES = {("trajectory", "finished")}


# -- builders ----------------------------------------------------------------------------------


def group(uid: str, n: int = 1, step: int = 0) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid, num_samples=n, prompt_step=step, prompt_token_ids=[1, 2, 3], data_source="arith"
    )


def trajectory(uid: str, index: int, writer: str = "test") -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[7, 8, 9],
        response_mask=b"\x01\x00\x01",
        rollout_logprobs=[-0.5, 0.0, -0.125],
        spans=[common_pb2.GenerationSpan(start=0, end=3, policy_version=0, generated=True)],
        finish_reason="stop",
        labels={"writer": writer},
    )


def reward(score: float) -> common_pb2.RewardResult:
    return common_pb2.RewardResult(status=common_pb2.REWARD_STATUS_OK, score=score)


def status_name(value: int, enum: type) -> str:
    return enum.Name(value).split("_STATUS_", 1)[1].lower()


def finished_groups_with_one_sample(tq: TransferQueue, num_groups: int) -> list[str]:
    """num_groups groups of 1 sample, claimed and written: one finished trajectory each."""
    uids = [f"g{i:03d}" for i in range(num_groups)]
    assert tq.put_groups(P, [group(uid) for uid in uids]).created == uids
    claimed = tq.claim_groups(P, max_groups=num_groups, claimer="gw", lease_s=600).claimed
    assert sorted(c.group.uid for c in claimed) == uids
    puts = [TrajectoryPut(trajectory(c.group.uid, 0), c.claim_id) for c in claimed]
    tq.put_trajectories(P, puts)
    return [f"{uid}_0" for uid in uids]


# -- worker processes, tracked by PID -----------------------------------------------------------


class Worker:
    """One tq_workers process; its stdout (JSON lines) and stderr go to files."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.name, self.process, self.out, self.err = name, process, out, err

    @property
    def pid(self) -> int:
        return self.process.pid

    def lines(self) -> list[dict]:
        text = self.out.read_text()
        # A line without its newline is still being written.
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def describe(self) -> str:
        return (
            f"worker {self.name} (pid {self.pid}, exit {self.process.poll()}):\n"
            f"stdout: {self.out.read_text()}\nstderr: {self.err.read_text()}"
        )

    def wait_for_line(self, key: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines():
                if key in line:
                    return line
            if self.process.poll() is not None:
                # Read once more: it may have written its last line just before exiting.
                for line in self.lines():
                    if key in line:
                        return line
                pytest.fail(f"exited before saying {key!r}; {self.describe()}")
            time.sleep(0.01)
        pytest.fail(f"did not say {key!r} within {timeout_s}s; {self.describe()}")

    def wait(self, timeout_s: float = 30.0) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout_s}s; {self.describe()}")

    def kill(self) -> None:
        """SIGKILL by PID (a crash); reaps the process."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []
    logs = tmp_path / "workers"
    logs.mkdir()

    def start(name: str, role: str, *args: object) -> Worker:
        out, err = logs / f"{name}.out", logs / f"{name}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", WORKERS, role, *map(str, args)],
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        worker = Worker(name, process, out, err)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()


# -- 1. concurrent claimers ---------------------------------------------------------------------


def run_claimers(
    start_worker: Callable[..., Worker], port: int, max_launched: int | None
) -> dict[str, list[dict]]:
    cap = [] if max_launched is None else ["--max-launched", max_launched]
    workers = [
        start_worker(
            name,
            "claim-loop",
            *("--port", port, "--claimer", name, "--seed", seed),
            *("--barrier-key", f"test:barrier:{max_launched}", *cap),
        )
        for seed, name in enumerate(["gw-a", "gw-b"])
    ]
    for worker in workers:
        assert worker.wait(60) == 0, worker.describe()
    return {w.name: w.lines() for w in workers}


def claimed_by(lines: list[dict]) -> list[str]:
    return [uid for line in lines for uid in line.get("claimed", [])]


def test_two_claimer_processes_never_claim_the_same_group(
    tq: TransferQueue, redis_server: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    uids = [f"g{i:03d}" for i in range(400)]
    tq.put_groups(P, [group(uid, step=i % 7) for i, uid in enumerate(uids)])

    lines = run_claimers(start_worker, redis_server.port, max_launched=None)

    a, b = claimed_by(lines["gw-a"]), claimed_by(lines["gw-b"])
    assert a and b, "the barrier makes each worker claim at least once"
    assert len(a) + len(b) == 400
    assert set(a) | set(b) == set(uids)
    assert set(a) & set(b) == set()
    # Each non-empty claim bumped the shared launched counter atomically: no two calls saw the
    # same value.
    launched = [line["num_launched"] for w in lines.values() for line in w if line.get("claimed")]
    assert len(launched) == len(set(launched))
    assert max(launched) == 400
    counts = tq.counts(P)
    assert counts.groups[GroupStatus.RUNNING] == 400
    assert counts.groups[GroupStatus.PENDING] == 0
    assert counts.num_launched == 400
    # The store agrees with what each worker was told: one claim per group, by that worker.
    claimers = {lease.uid: lease.claimer for lease in tq.leases(P)}
    for name, mine in (("gw-a", a), ("gw-b", b)):
        for uid in mine:
            assert claimers[uid] == name
    groups = tq.get_groups(P, uids, with_trajectories=False)
    assert {g.group.tags.num_claims for g in groups} == {1}


def test_two_claimer_processes_together_respect_max_launched(
    tq: TransferQueue, redis_server: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    uids = [f"g{i:03d}" for i in range(400)]
    tq.put_groups(P, [group(uid) for uid in uids])

    lines = run_claimers(start_worker, redis_server.port, max_launched=150)

    a, b = claimed_by(lines["gw-a"]), claimed_by(lines["gw-b"])
    assert a and b
    assert len(a) + len(b) == 150
    assert set(a) & set(b) == set()
    # Oldest first (all at step 0, so by uid): the first 150.
    assert sorted(a + b) == uids[:150]
    assert all(
        line["num_launched"] <= 150 for w in lines.values() for line in w if line.get("claimed")
    )
    counts = tq.counts(P)
    assert counts.groups[GroupStatus.RUNNING] == 150
    assert counts.groups[GroupStatus.PENDING] == 250
    assert counts.num_launched == 150


# -- 2. a consumer killed mid-batch --------------------------------------------------------------


def test_consumer_killed_mid_batch_is_redelivered_and_processed_once_in_effect(
    tq: TransferQueue, redis_server: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    keys = finished_groups_with_one_sample(tq, 40)
    worker_a = start_worker(
        "reader-a",
        "score-half-then-hang",
        *("--port", redis_server.port, "--group", "reward", "--reader", "A"),
        *("--count", 40, "--reclaim-idle-s", 0.5),
    )
    said = worker_a.wait_for_line("scored", timeout_s=30)
    assert said["event"] == "scored-half"
    assert sorted(said["keys"]) == keys
    assert said["deliveries"] == [1] * 40
    first_half, second_half = said["keys"][:20], said["keys"][20:]
    assert said["scored"] == first_half
    worker_a.kill()

    consumer_b = EventConsumer(
        tq, P, group="reward", reader="B", wants=FINISHED_TRAJECTORIES, reclaim_idle_s=0.5
    )
    reclaimed, scored_by_b = [], []
    deadline = time.monotonic() + 30
    while len(reclaimed) < 40 and time.monotonic() < deadline:
        events = consumer_b.read(count=100, block_s=0.2)
        if events:
            reclaimed += events
            scored_by_b += tq.score_trajectories(P, {e.key: reward(0.0) for e in events})
            consumer_b.ack(events)
    assert sorted(e.key for e in reclaimed) == keys
    assert sorted(e.id for e in reclaimed) == sorted(said["ids"])
    assert {e.deliveries for e in reclaimed} == {2}
    # A's scores stand; B's scoring of those keys was a no-op.
    assert sorted(scored_by_b) == sorted(second_half)

    # Nothing more comes back, even after the reclaim idle time.
    time.sleep(0.6)
    assert consumer_b.read(count=100, block_s=0.2) == []
    assert consumer_b.pending_count() == 0
    for trajectory_ in tq.get_trajectories(P, keys):
        key = f"{trajectory_.uid}_{trajectory_.index}"
        assert status_name(trajectory_.tags.status, common_pb2.TrajectoryStatus) == "scored"
        assert trajectory_.reward.score == (1.0 if key in first_half else 0.0)
    scored_events = Counter(
        e.key
        for e in tq.read_events(P, count=10_000)
        if e.kind == "trajectory" and (e.from_status, e.to_status) == ("finished", "scored")
    )
    assert scored_events == Counter(keys)
    counts = tq.counts(P)
    assert counts.groups[GroupStatus.SCORED] == 40
    assert counts.trajectories[TrajectoryStatus.SCORED] == 40
    assert counts.trajectories[TrajectoryStatus.FINISHED] == 0


# -- 3. dead letters ---------------------------------------------------------------------------


def test_entry_delivered_max_deliveries_times_without_ack_is_dead_lettered(
    tq: TransferQueue, redis_server: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    keys = finished_groups_with_one_sample(tq, 3)
    poison, good = keys[0], keys[1:]
    poison_event = next(e for e in tq.read_events(P) if e.key == poison)
    max_deliveries = 3

    exits, said = [], []
    for attempt in range(max_deliveries + 2):
        worker = start_worker(
            f"reader-{attempt}",
            "consume-until-poison",
            *("--port", redis_server.port, "--group", "reward", "--reader", f"r{attempt}"),
            *("--poison", poison, "--reclaim-idle-s", 0.2),
            *("--max-deliveries", max_deliveries, "--quiet-exit-s", 0.6),
        )
        exits.append(worker.wait(60))
        said += worker.lines()
        if exits[-1] == 0:
            break

    # Readers r0, r1, r2 each got the poison entry and died on it; r3 found it dead-lettered.
    assert exits == [3, 3, 3, 0], said
    assert [line["deliveries"] for line in said if "poison" in line] == [1, 2, 3]
    acked = [line for line in said if "acked" in line]
    assert [(line["acked"], line["deliveries"], line["scored"]) for line in acked] == [
        (good, [1, 1], good)
    ]

    auditor = EventConsumer(
        tq,
        P,
        group="reward",
        reader="auditor",
        wants=FINISHED_TRAJECTORIES,
        reclaim_idle_s=0.2,
        max_deliveries=max_deliveries,
    )
    dead = auditor.dead_letters()
    assert [(e.key, e.kind, e.to_status) for e in dead] == [(poison, "trajectory", "finished")]
    assert dead[0].extra["dead_id"] == poison_event.id
    assert dead[0].extra["dead_deliveries"] == str(max_deliveries)
    assert dead[0].extra["dead_group"] == "reward"
    assert dead[0].extra["dead_reader"] == "r2"
    assert auditor.pending_count() == 0
    time.sleep(0.3)
    assert auditor.read(count=100, block_s=0.2) == []

    # The others were scored once; the poison trajectory was never scored.
    statuses = {
        f"{t.uid}_{t.index}": status_name(t.tags.status, common_pb2.TrajectoryStatus)
        for t in tq.get_trajectories(P, keys)
    }
    assert statuses == {poison: "finished", good[0]: "scored", good[1]: "scored"}
    assert tq.counts(P).groups[GroupStatus.SCORED] == 2

    # The cause fixed, an operator re-drives the dead letter with the real CLI, and a reader
    # that no longer crashes on it scores it: nothing given up on is lost for good.
    relayrl = str(Path(sys.executable).parent / "relayrl")
    redrive = subprocess.run(
        [relayrl, "tq", "--url", redis_server.url, "redrive", P],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert redrive.returncode == 0, redrive.stderr
    assert f"{P}: re-drove 1 dead letters" in redrive.stdout, redrive.stdout
    fixed = start_worker(
        "fixed",
        "consume-until-poison",
        *("--port", redis_server.port, "--group", "reward", "--reader", "fixed"),
        *("--poison", "none", "--reclaim-idle-s", 0.2),
        *("--max-deliveries", max_deliveries, "--quiet-exit-s", 0.6),
    )
    assert fixed.wait(60) == 0, fixed.lines()
    assert [line["acked"] for line in fixed.lines() if "acked" in line] == [[poison]]
    assert tq.num_dead_letters(P) == 0
    assert tq.counts(P).groups[GroupStatus.SCORED] == 3


# -- 4. lease expiry after a gateway crash ------------------------------------------------------


def test_lease_expiry_after_gateway_crash_hands_the_missing_samples_to_a_new_claimer(
    tq: TransferQueue, redis_server: RedisServer, start_worker: Callable[..., Worker]
) -> None:
    tq.put_groups(P, [group("g", n=4)])
    gateway_a = start_worker(
        "gateway-a",
        "gateway-crash",
        *("--port", redis_server.port, "--claimer", "gateway-a"),
        *("--lease-s", 1, "--num-write", 2),
    )
    said = gateway_a.wait_for_line("written", timeout_s=30)
    assert said["missing"] == [0, 1, 2, 3]
    assert said["written"] == ["g_0", "g_1"]
    gateway_a.kill()
    old_claim = said["claim_id"]

    requeued: list[str] = []
    deadline = time.monotonic() + 15
    while not requeued and time.monotonic() < deadline:
        requeued = tq.requeue_expired(P)
        time.sleep(0.05)
    assert requeued == ["g"]
    assert tq.counts(P).num_launched == 0
    with pytest.raises(StaleClaimError, match="no longer running"):
        tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 2, "gateway-a"), old_claim)])

    result = tq.claim_groups(P, max_groups=1, claimer="gateway-b", lease_s=60)
    [claim] = result.claimed
    assert claim.missing_indices == [2, 3]
    assert claim.claim_id != old_claim
    with pytest.raises(StaleClaimError, match="superseded"):
        tq.put_trajectories(P, [TrajectoryPut(trajectory("g", 2, "gateway-a"), old_claim)])
    assert tq.get_groups(P, ["g"])[0].group.tags.num_finished == 2

    puts = [TrajectoryPut(trajectory("g", i, "gateway-b"), claim.claim_id) for i in (2, 3)]
    assert tq.put_trajectories(P, puts).created == ["g_2", "g_3"]

    [stored] = tq.get_groups(P, ["g"])
    assert status_name(stored.group.tags.status, common_pb2.GroupStatus) == "finished"
    assert stored.group.tags.num_finished == 4
    assert stored.group.tags.num_claims == 2
    assert [t.index for t in stored.trajectories] == [0, 1, 2, 3]
    assert [t.labels["writer"] for t in stored.trajectories] == ["gateway-a"] * 2 + [
        "gateway-b"
    ] * 2
    transitions = [(e.from_status, e.to_status, e.extra) for e in tq.read_events(P) if e.key == "g"]
    assert [(f, t) for f, t, _ in transitions] == [
        ("", "pending"),
        ("pending", "running"),
        ("running", "pending"),
        ("pending", "running"),
        ("running", "finished"),
    ]
    assert transitions[2][2]["reason"] == "lease_expired"
    counts = tq.counts(P)
    assert counts.trajectories[TrajectoryStatus.FINISHED] == 4
    assert counts.num_launched == 1
