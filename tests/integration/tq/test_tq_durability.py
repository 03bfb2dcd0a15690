"""Durability of the TransferQueue across a redis-server crash: each test runs its own
redis-server on its own AOF data dir, SIGKILLs it (by PID) and starts it again on the same dir.

The promise (TQConfig.durability): with appendfsync=always every acknowledged transition
survives; with everysec an acknowledged transition may be lost only on a machine crash within
~1 s (2 s when a background fsync stalls), while a killed redis-server process loses nothing that
reached the AOF. Whatever survives is a consistent prefix: each Lua transition is applied whole
or not at all, so statuses, counters, indexes and the event log always agree.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import (
    EventConsumer,
    GroupStatus,
    TrajectoryPut,
    TrajectoryStatus,
    TransferQueue,
)
from relayrl.tq.queue import DurabilityError, TQUnavailableError
from relayrl.tq.server import RedisServer
from relayrl.tq.testing import key_prefix_for_tests

P = "train"
NS = "relayrl"
# partition_problems checks the raw keys against each other on purpose; the rest reads the queue
PREFIX = key_prefix_for_tests(NS, P)
FINISHED_TRAJECTORIES = {("trajectory", "finished")}
# The everysec window: 1 s, 2 s worst case when a background fsync stalls; plus margin.
EVERYSEC_WINDOW_S = 2.5

Fsync = Literal["always", "everysec"]
Transition = tuple[str, str, str, str]  # kind, key, from, to


# -- builders ----------------------------------------------------------------------------------


def group(uid: str, n: int = 3, step: int = 0) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(
        uid=uid, num_samples=n, prompt_step=step, prompt_token_ids=[1, 2, 3], data_source="arith"
    )


def trajectory(uid: str, index: int) -> common_pb2.Trajectory:
    """Different bytes for every key, so a mixed-up or truncated value cannot pass."""
    seed = zlib.crc32(f"{uid}_{index}".encode())
    num_tokens = 3 + seed % 29
    return common_pb2.Trajectory(
        uid=uid,
        index=index,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[(seed + i) % 50_000 for i in range(num_tokens)],
        response_mask=bytes((seed >> i) & 1 for i in range(num_tokens)),
        rollout_logprobs=[-((seed + i) % 97) / 97 for i in range(num_tokens)],
        spans=[common_pb2.GenerationSpan(start=0, end=num_tokens, policy_version=seed % 5)],
        finish_reason="stop",
    )


def score_for(key: str) -> float:
    return (zlib.crc32(key.encode()) % 1000) / 1000


def status_name(value: int, enum: type) -> str:
    return enum.Name(value).split("_STATUS_", 1)[1].lower()


# -- servers -----------------------------------------------------------------------------------


@contextmanager
def private_server(data_dir: Path, appendfsync: Fsync) -> Iterator[RedisServer]:
    server = RedisServer(data_dir, appendfsync=appendfsync)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def connect(server: RedisServer, durability: Fsync) -> TransferQueue:
    # No automatic retries: a call cut by the crash must fail, not run again on a new server.
    client = server.client(socket_timeout=10, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))
    return TransferQueue(client, durability=durability)


def crash_and_restart(server: RedisServer, tq: TransferQueue, durability: Fsync) -> TransferQueue:
    server.kill()
    tq.close()
    server.start()
    return connect(server, durability)


# -- what the queue acknowledged ----------------------------------------------------------------


@dataclass
class Ledger:
    """Calls the queue and records what each call acknowledged, and the state and event log
    (in the order the Lua scripts emit it) that those acknowledgements imply."""

    events: list[Transition] = field(default_factory=list)
    groups: dict[str, str] = field(default_factory=dict)  # uid -> status
    num_samples: dict[str, int] = field(default_factory=dict)
    claims: dict[str, str] = field(default_factory=dict)
    data: dict[str, bytes] = field(default_factory=dict)  # trajectory key -> stored bytes
    trajectories: dict[str, str] = field(default_factory=dict)  # key -> status
    scores: dict[str, float] = field(default_factory=dict)
    consumed_step: dict[str, int] = field(default_factory=dict)
    # The "reward" consumer group: entries delivered to reader "scorer" and not acked, and how
    # many events of the log it has been delivered.
    pending: dict[str, str] = field(default_factory=dict)  # event id -> key
    num_delivered: int = 0
    num_calls: int = 0

    def _emit(self, kind: str, key: str, src: str, dst: str) -> None:
        self.events.append((kind, key, src, dst))

    def _group_to(self, uid: str, status: str) -> None:
        self._emit("group", uid, self.groups[uid], status)
        self.groups[uid] = status

    def _settle(self, uid: str) -> None:
        """Mirrors settle_group: running -> finished -> scored as samples are written and
        scored."""
        mine = [s for k, s in self.trajectories.items() if k.rpartition("_")[0] == uid]
        n = self.num_samples[uid]
        if self.groups[uid] == "running" and len(mine) == n:
            self.claims.pop(uid)
            self._group_to(uid, "finished")
        if self.groups[uid] == "finished" and sum(s != "finished" for s in mine) == n:
            self._group_to(uid, "scored")

    def put_groups(self, tq: TransferQueue, groups: list[common_pb2.PromptGroup]) -> None:
        created = set(tq.put_groups(P, groups).created)
        self.num_calls += 1
        for g in groups:
            if g.uid in created:
                self._emit("group", g.uid, "", "pending")
                self.groups[g.uid] = "pending"
                self.num_samples[g.uid] = g.num_samples

    def claim(self, tq: TransferQueue, max_groups: int) -> list[str]:
        result = tq.claim_groups(P, max_groups=max_groups, claimer="gw", lease_s=3600)
        self.num_calls += 1
        for claimed in result.claimed:
            uid = claimed.group.uid
            self._group_to(uid, "running")
            self.claims[uid] = claimed.claim_id
        return [c.group.uid for c in result.claimed]

    def release(self, tq: TransferQueue, uids: list[str]) -> None:
        assert tq.release_groups(P, {u: self.claims[u] for u in uids}, reason="drain") == len(uids)
        self.num_calls += 1
        for uid in uids:
            self.claims.pop(uid)
            self._group_to(uid, "pending")

    def put_trajectories(self, tq: TransferQueue, indices: dict[str, list[int]]) -> None:
        built = [trajectory(uid, i) for uid, idx in indices.items() for i in idx]
        puts = [TrajectoryPut(t, self.claims[t.uid]) for t in built]
        created = set(tq.put_trajectories(P, puts).created)
        self.num_calls += 1
        touched: list[str] = []
        for t in built:
            key = f"{t.uid}_{t.index}"
            if key in created:
                self._emit("trajectory", key, "", "finished")
                self.trajectories[key] = "finished"
                self.data[key] = t.SerializeToString(deterministic=True)
                touched += [] if t.uid in touched else [t.uid]
        for uid in touched:
            self._settle(uid)

    def score(self, tq: TransferQueue, keys: list[str], offset: float = 0.0) -> list[str]:
        rewards = {
            k: common_pb2.RewardResult(
                status=common_pb2.REWARD_STATUS_OK, score=score_for(k) + offset
            )
            for k in keys
        }
        scored = tq.score_trajectories(P, rewards)
        self.num_calls += 1
        touched: list[str] = []
        for key in scored:
            self._emit("trajectory", key, "finished", "scored")
            self.trajectories[key] = "scored"
            self.scores[key] = rewards[key].score
            uid = key.rpartition("_")[0]
            touched += [] if uid in touched else [uid]
        for uid in touched:
            self._settle(uid)
        return scored

    def consume(self, tq: TransferQueue, step: int, num_groups: int) -> list[str]:
        uids = tq.consume(P, step, num_groups)
        self.num_calls += 1
        for uid in uids:
            if self.groups[uid] != "consumed":
                self._group_to(uid, "consumed")
                self.consumed_step[uid] = step
        return uids

    def _scorer(self, tq: TransferQueue) -> EventConsumer:
        return EventConsumer(
            tq, P, group="reward", reader="scorer", wants=FINISHED_TRAJECTORIES, reclaim_idle_s=3600
        )

    def read_as_scorer(self, tq: TransferQueue) -> None:
        events = self._scorer(tq).read(count=100_000, block_s=0.1)
        self.num_calls += 1
        new = self.events[self.num_delivered :]
        assert [e.key for e in events] == [
            k for kind, k, src, _ in new if (kind, src) == ("trajectory", "")
        ]
        self.num_delivered = len(self.events)
        self.pending.update((e.id, e.key) for e in events)

    def ack_as_scorer(self, tq: TransferQueue, keys: list[str]) -> None:
        ids = [i for i, key in self.pending.items() if key in keys]
        assert self._scorer(tq).ack(ids) == len(ids) == len(keys)
        self.num_calls += 1
        for i in ids:
            del self.pending[i]


def workload() -> list[tuple[str, Callable[[TransferQueue, Ledger], object]]]:
    """A sequence of transitions of every kind; each entry is one call to the queue."""
    first = [f"g{i}" for i in range(6)]
    return [
        (
            "put 6 groups",
            lambda tq, led: led.put_groups(tq, [group(u, step=i) for i, u in enumerate(first)]),
        ),
        (
            "retried put of the 6 plus 2 new",
            lambda tq, led: led.put_groups(
                tq, [group(u, step=i) for i, u in enumerate([*first, "g6", "g7"])]
            ),
        ),
        ("claim 5", lambda tq, led: led.claim(tq, 5)),
        ("write g0", lambda tq, led: led.put_trajectories(tq, {"g0": [0, 1, 2]})),
        (
            "write g1 and g2",
            lambda tq, led: led.put_trajectories(tq, {"g1": [0, 1, 2], "g2": [2, 0, 1]}),
        ),
        ("write one sample of g3", lambda tq, led: led.put_trajectories(tq, {"g3": [1]})),
        ("scorer reads", lambda tq, led: led.read_as_scorer(tq)),
        ("score g0", lambda tq, led: led.score(tq, ["g0_0", "g0_1", "g0_2"])),
        ("scorer acks g0", lambda tq, led: led.ack_as_scorer(tq, ["g0_0", "g0_1", "g0_2"])),
        ("score part of g1", lambda tq, led: led.score(tq, ["g1_0", "g1_1"])),
        ("score the rest of g1, g0_0 again", lambda tq, led: led.score(tq, ["g1_2", "g0_0"], 0.5)),
        ("release g4", lambda tq, led: led.release(tq, ["g4"])),
        ("consume 1 at step 1", lambda tq, led: led.consume(tq, 1, 1)),
        ("consume 2 at step 1 (a retried step)", lambda tq, led: led.consume(tq, 1, 2)),
        ("claim 2 more", lambda tq, led: led.claim(tq, 2)),
        ("write g3 to the end", lambda tq, led: led.put_trajectories(tq, {"g3": [0, 2]})),
        ("scorer reads again", lambda tq, led: led.read_as_scorer(tq)),
        ("score g2", lambda tq, led: led.score(tq, ["g2_0", "g2_1", "g2_2"])),
    ]


# -- checks ------------------------------------------------------------------------------------


def stored_events(tq: TransferQueue) -> list[tuple[str, Transition]]:
    return [
        (e.id, (e.kind, e.key, e.from_status, e.to_status))
        for e in tq.read_events(P, "-", 1_000_000)
    ]


def assert_everything_acknowledged_is_there(tq: TransferQueue, ledger: Ledger) -> None:
    client = tq.redis
    events = stored_events(tq)
    assert [t for _, t in events] == ledger.events

    groups = tq.get_groups(P, list(ledger.groups), with_trajectories=False)
    assert {
        g.group.uid: status_name(g.group.tags.status, common_pb2.GroupStatus) for g in groups
    } == ledger.groups
    for g in groups:
        if g.group.uid in ledger.consumed_step:
            assert g.group.tags.consumed_step == ledger.consumed_step[g.group.uid]
    claims = {lease.uid: lease.claim_id for lease in tq.leases(P)}
    for uid, claim_id in ledger.claims.items():
        assert claims[uid] == claim_id

    keys = list(ledger.trajectories)
    for key, stored in zip(keys, tq.get_trajectories(P, keys), strict=True):
        assert client.get(f"{PREFIX}td:{key}") == ledger.data[key]
        assert (
            status_name(stored.tags.status, common_pb2.TrajectoryStatus) == ledger.trajectories[key]
        )
        if key in ledger.scores:
            assert stored.reward.score == ledger.scores[key]
        else:
            assert not stored.HasField("reward")

    counts = tq.counts(P)
    assert counts.groups == {s: Counter(ledger.groups.values())[s.value] for s in GroupStatus}
    assert counts.trajectories == {
        s: Counter(ledger.trajectories.values())[s.value] for s in TrajectoryStatus
    }
    assert counts.num_launched == sum(s != "pending" for s in ledger.groups.values())

    if ledger.num_delivered:
        [info] = tq.consumer_groups(P).values()
        assert info.name == "reward"
        assert info.last_delivered_id == events[ledger.num_delivered - 1][0]
        assert {p.id: p.deliveries for p in info.pending} == {i: 1 for i in ledger.pending}
        assert {p.reader for p in info.pending} <= {"scorer"}
    assert partition_problems(tq) == []


def partition_problems(tq: TransferQueue) -> list[str]:
    """Every way the raw keys of partition P could disagree with each other (see the key layout
    in relayrl.tq.queue): a half-applied transition shows up here."""
    client = tq.redis
    problems: list[str] = []

    def hashes(kind: str) -> dict[str, dict[bytes, bytes]]:
        found = client.scan_iter(match=f"{PREFIX}{kind}:*", count=1000)
        return {k.decode()[len(PREFIX) + len(kind) + 1 :]: client.hgetall(k) for k in found}

    def text(fields: dict[bytes, bytes], name: str, default: str = "") -> str:
        return fields.get(name.encode(), default.encode()).decode()

    groups, trajs = hashes("g"), hashes("t")
    index = {
        s.value: {
            m.decode(): sc
            for m, sc in client.zrange(f"{PREFIX}gs:{s.value}", 0, -1, withscores=True)
        }
        for s in GroupStatus
    }
    leases = {m.decode() for m in client.zrange(f"{PREFIX}leases", 0, -1)}
    events = [t for _, t in stored_events(tq)]

    last: dict[tuple[str, str], str] = {}
    claims_of: Counter[str] = Counter()
    for kind, key, src, dst in events:
        if last.get((kind, key), "") != src:
            problems.append(f"event {kind} {key} {src}->{dst} after {last.get((kind, key))!r}")
        last[(kind, key)] = dst
        if (kind, src, dst) == ("group", "pending", "running"):
            claims_of[key] += 1
    for kind, key in last:
        if key not in (groups if kind == "group" else trajs):
            problems.append(f"event for missing {kind} {key}")

    by_group: dict[str, list[tuple[int, str]]] = {}
    for key, f in trajs.items():
        uid, _, index_text = key.rpartition("_")
        status = text(f, "status")
        by_group.setdefault(uid, []).append((int(index_text), status))
        if text(f, "uid") != uid:
            problems.append(f"trajectory {key} says uid {text(f, 'uid')!r}")
        if last.get(("trajectory", key)) != status:
            problems.append(
                f"trajectory {key} is {status}, its last event {last.get(('trajectory', key))}"
            )
        if (b"reward" in f) != (status == "scored"):
            problems.append(f"trajectory {key} is {status} with reward={b'reward' in f}")

    for uid, f in groups.items():
        status, n = text(f, "status"), int(text(f, "n"))
        num_put, num_failed, num_scored = (
            int(text(f, c, "0")) for c in ("num_put", "num_failed", "num_scored")
        )
        mine = by_group.get(uid, [])
        where = f"group {uid} ({status}, n={n}, put={num_put}, failed={num_failed}, "
        where += f"scored={num_scored})"
        if [s for s, members in index.items() if uid in members] != [status]:
            problems.append(f"{where} is indexed under {[s for s, m in index.items() if uid in m]}")
        else:
            want = text(f, "consumed_step") if status == "consumed" else text(f, "step")
            if index[status][uid] != float(want):
                problems.append(f"{where} indexed with score {index[status][uid]}, not {want}")
        if last.get(("group", uid)) != status:
            problems.append(f"{where}: its last event says {last.get(('group', uid))}")
        if any(i >= n for i, _ in mine):
            problems.append(f"{where} has a trajectory index outside its samples")
        actual = Counter(s for _, s in mine)
        if (num_put, num_failed, num_scored) != (len(mine), actual["failed"], actual["scored"]):
            problems.append(f"{where} but has trajectories {dict(actual)}")
        settled = num_failed + num_scored
        expected_shape = {
            "pending": num_put < n,
            "running": num_put < n,
            "failed": num_put < n,
            "finished": num_put == n and settled < n,
            "scored": num_put == n and settled == n,
            "consumed": num_put == n and settled == n,
            "dropped": num_put == n,
        }[status]
        if not expected_shape:
            problems.append(f"{where}: counters do not fit the status")
        running, holds_claim, holds_lease = status == "running", b"claim" in f, uid in leases
        if not running == holds_claim == holds_lease:
            problems.append(f"{where}: claim={holds_claim}, lease={holds_lease}")
        if int(text(f, "num_claims", "0")) != claims_of[uid]:
            problems.append(
                f"{where}: num_claims {text(f, 'num_claims')} != {claims_of[uid]} claim events"
            )
    for status, members in index.items():
        for uid in members:
            if uid not in groups:
                problems.append(f"index {status} holds missing group {uid}")
    for uid in leases - set(groups):
        problems.append(f"lease of missing group {uid}")

    tcount = {k.decode(): int(v) for k, v in client.hgetall(f"{PREFIX}tcount").items() if int(v)}
    actual_tcount = Counter(text(f, "status") for f in trajs.values())
    if tcount != dict(actual_tcount):
        problems.append(f"tcount {tcount} != trajectories {dict(actual_tcount)}")
    launched = int(client.get(f"{PREFIX}launched") or 0)
    not_pending = sum(text(f, "status") != "pending" for f in groups.values())
    if launched != not_pending:
        problems.append(f"launched {launched} != {not_pending} groups claimed and not pending")
    return problems


def raw_snapshot(client: redis.Redis) -> dict[bytes, object]:
    """Every key's value (streams: entries, consumer groups and their pending entries)."""
    out: dict[bytes, object] = {}
    for key in sorted(client.scan_iter(count=1000)):
        kind = client.type(key).decode()
        if kind == "stream":
            groups = [
                (
                    g["name"],
                    g["last-delivered-id"],
                    [
                        (p["message_id"], p["consumer"], p["times_delivered"])
                        for p in client.xpending_range(key, g["name"], "-", "+", 100_000)
                    ],
                )
                for g in client.xinfo_groups(key)
            ]
            out[key] = (client.xrange(key), groups)
        elif kind == "hash":
            out[key] = client.hgetall(key)
        elif kind == "zset":
            out[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            out[key] = client.smembers(key)
        else:
            assert kind == "string", key
            out[key] = client.get(key)
    return out


# -- appendfsync=always ------------------------------------------------------------------------


def test_always_keeps_every_transition_acknowledged_right_before_a_kill(tmp_path: Path) -> None:
    """After each call, at once: SIGKILL, restart on the same AOF, and everything acknowledged
    so far (statuses, counters, event log, trajectory bytes, rewards, consumer group) is there."""
    ledger = Ledger()
    with private_server(tmp_path / "redis", "always") as server:
        tq = connect(server, "always")
        tq.check_durability()
        tq.create_partition(P)
        try:
            for name, step in workload():
                step(tq, ledger)
                tq = crash_and_restart(server, tq, "always")
                try:
                    assert_everything_acknowledged_is_there(tq, ledger)
                except AssertionError as exc:
                    raise AssertionError(f"after {name!r}: {exc}") from exc
            assert ledger.groups == {
                "g0": "consumed",
                "g1": "consumed",
                "g2": "scored",
                "g3": "finished",
                "g4": "running",
                "g5": "running",
                "g6": "pending",
                "g7": "pending",
            }
            assert len(ledger.pending) == 9 and ledger.scores["g0_0"] == score_for("g0_0")
        finally:
            tq.close()


def write_until_killed(tq: TransferQueue, ledger: Ledger, errors: list[BaseException]) -> None:
    """A rollout loop as fast as the queue acknowledges: put, claim, write, score, consume."""
    try:
        for i in range(100_000):
            uid = f"s{i:05d}"
            ledger.put_groups(tq, [group(uid, n=2, step=i)])
            assert ledger.claim(tq, 1) == [uid]
            ledger.put_trajectories(tq, {uid: [0, 1]})
            ledger.score(tq, [f"{uid}_0", f"{uid}_1"])
            if i % 3 == 2:
                ledger.consume(tq, i, 2)
    except BaseException as exc:
        errors.append(exc)


def crash_during_writes(server: RedisServer, tq: TransferQueue, min_calls: int) -> Ledger:
    """Kills the server while a writer thread is in the middle of its stream of calls."""
    ledger, errors = Ledger(), []
    writer = threading.Thread(target=write_until_killed, args=(tq, ledger, errors), daemon=True)
    writer.start()
    deadline = time.monotonic() + 60
    while ledger.num_calls < min_calls and writer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    server.kill()
    writer.join(15)
    assert not writer.is_alive()
    assert ledger.num_calls >= min_calls, errors
    assert len(errors) == 1 and isinstance(errors[0], TQUnavailableError), errors
    return ledger


@contextmanager
def restarted_after_a_kill_mid_stream(
    tmp_path: Path, fsync: Fsync
) -> Iterator[tuple[TransferQueue, Ledger]]:
    """A writer streams transitions, redis-server is SIGKILLed under it and started again on the
    same data dir; yields a client of the restarted server and what was acknowledged."""
    with private_server(tmp_path / "redis", fsync) as server:
        tq = connect(server, fsync)
        tq.create_partition(P)
        ledger = crash_during_writes(server, tq, min_calls=300)
        tq.close()
        server.start()
        tq = connect(server, fsync)
        try:
            yield tq, ledger
        finally:
            tq.close()


def test_always_keeps_every_acknowledged_transition_when_killed_mid_stream(tmp_path: Path) -> None:
    with restarted_after_a_kill_mid_stream(tmp_path, "always") as (tq, ledger):
        events = [t for _, t in stored_events(tq)]
        # Every acknowledged transition is there; beyond it at most the call in flight.
        assert events[: len(ledger.events)] == ledger.events
        assert len(events) - len(ledger.events) <= 3
        for key, data in ledger.data.items():
            assert tq.redis.get(f"{PREFIX}td:{key}") == data
        assert partition_problems(tq) == []


# -- appendfsync=everysec ----------------------------------------------------------------------


def test_everysec_keeps_everything_acknowledged_once_the_fsync_window_passed(
    tmp_path: Path,
) -> None:
    ledger = Ledger()
    with private_server(tmp_path / "redis", "everysec") as server:
        tq = connect(server, "everysec")
        tq.check_durability()
        tq.create_partition(P)
        try:
            for _, step in workload():
                step(tq, ledger)
            last_ack = time.monotonic()
            before = raw_snapshot(tq.redis)
            time.sleep(max(0.0, last_ack + EVERYSEC_WINDOW_S - time.monotonic()))
            tq = crash_and_restart(server, tq, "everysec")
            assert raw_snapshot(tq.redis) == before
            assert_everything_acknowledged_is_there(tq, ledger)
        finally:
            tq.close()


def assert_consistent_prefix(tq: TransferQueue, ledger: Ledger) -> None:
    events = [t for _, t in stored_events(tq)]
    if len(events) <= len(ledger.events):
        assert events == ledger.events[: len(events)]
    else:  # the call in flight at the kill was applied, unacknowledged
        assert events[: len(ledger.events)] == ledger.events
    assert partition_problems(tq) == []


def test_everysec_kill_right_after_the_last_ack_leaves_a_consistent_prefix(tmp_path: Path) -> None:
    ledger = Ledger()
    with private_server(tmp_path / "redis", "everysec") as server:
        tq = connect(server, "everysec")
        tq.create_partition(P)
        try:
            for _, step in workload():
                step(tq, ledger)
            tq = crash_and_restart(server, tq, "everysec")
            assert_consistent_prefix(tq, ledger)
        finally:
            tq.close()


def test_everysec_kill_mid_stream_leaves_a_consistent_prefix(tmp_path: Path) -> None:
    with restarted_after_a_kill_mid_stream(tmp_path, "everysec") as (tq, ledger):
        assert_consistent_prefix(tq, ledger)


# -- check_durability ---------------------------------------------------------------------------


def test_check_durability_names_both_settings_when_the_server_differs(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    try:
        with pytest.raises(DurabilityError) as info:
            TransferQueue(client, durability="always").check_durability()
        assert "appendfsync=everysec" in str(info.value)
        assert "appendfsync=always" in str(info.value)
        TransferQueue(client, durability="everysec").check_durability()

        # It reads the live config: a server switched to always now matches "always".
        client.config_set("appendfsync", "always")
        TransferQueue(client, durability="always").check_durability()
        with pytest.raises(DurabilityError, match="appendfsync=everysec"):
            TransferQueue(client, durability="everysec").check_durability()

        client.config_set("appendonly", "no")
        with pytest.raises(DurabilityError, match="appendonly=no"):
            TransferQueue(client, durability="always").check_durability()
    finally:
        client.close()
