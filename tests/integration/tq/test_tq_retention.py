"""What the TransferQueue keeps, against a real redis-server: the event stream is trimmed to its
length only through entries every consumer group has acknowledged (work is never trimmed
away, only history); dead letters wait for an operator and can be re-driven; a service refuses
a Redis without AOF unless durability is off on purpose."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from relayrl.core.service_process import ServiceProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import EventConsumer, TransferQueue
from relayrl.tq.queue import DurabilityError
from relayrl.tq.server import RedisServer

P = "train"


def groups(n: int, start: int = 0) -> list[common_pb2.PromptGroup]:
    return [
        common_pb2.PromptGroup(uid=f"g{i}", num_samples=1, prompt_token_ids=[1, 2])
        for i in range(start, start + n)
    ]


def short_queue(redis_server: RedisServer, max_len: int) -> TransferQueue:
    tq = TransferQueue(redis_server.client(), event_stream_max_len=max_len)
    tq.create_partition(P)
    return tq


def event_keys(tq: TransferQueue) -> list[str]:
    return [e.key for e in tq.read_events(P, "-", 10_000)]


def test_without_consumer_groups_the_stream_keeps_its_last_max_len_entries(
    redis_server: RedisServer,
) -> None:
    tq = short_queue(redis_server, 10)
    tq.put_groups(P, groups(25))
    assert tq.event_stream_length(P) == 10
    assert event_keys(tq) == [f"g{i}" for i in range(15, 25)]


def test_an_entry_a_consumer_group_has_not_acknowledged_is_never_trimmed(
    redis_server: RedisServer,
) -> None:
    tq = short_queue(redis_server, 10)
    reader = EventConsumer(tq, P, group="reward", reader="r0", reclaim_idle_s=60)
    tq.put_groups(P, groups(5))
    delivered = reader.read(count=5, block_s=0.1)
    reader.ack(delivered[:2])  # g2, g3, g4 stay pending
    tq.put_groups(P, groups(40, start=5))  # 40 more, none delivered yet

    # over max_len: everything from the first unacknowledged entry on is still there
    assert tq.event_stream_length(P) == 43
    assert event_keys(tq) == [f"g{i}" for i in range(2, 45)]
    assert [e.key for e in reader.read(count=100, block_s=0.1)][:2] == ["g5", "g6"]

    # once the group has acknowledged them, the next transition trims back to max_len
    rest = reader.read(count=100, block_s=0.1)
    reader.ack(delivered[2:])
    reader.ack(rest)
    reader.ack([e for e in tq.read_events(P, "-", 10_000)])
    tq.put_groups(P, groups(1, start=45))
    assert tq.event_stream_length(P) == 10
    assert event_keys(tq) == [f"g{i}" for i in range(36, 46)]
    assert reader.pending_count() == 0


def test_the_dead_letter_stream_is_kept_until_redriven(redis_server: RedisServer) -> None:
    tq = short_queue(redis_server, 10)
    reader = EventConsumer(
        tq, P, group="reward", reader="r0", reclaim_idle_s=0.001, max_deliveries=1
    )
    tq.put_groups(P, groups(3))
    assert len(reader.read(count=3, block_s=0.1)) == 3  # delivered once, never acknowledged
    time.sleep(0.05)  # idle past reclaim_idle_s
    assert reader.read(count=3, block_s=0.01) == []  # given up on: dead letters now
    assert tq.num_dead_letters(P) == 3 and reader.pending_count() == 0
    tq.put_groups(P, groups(30, start=3))  # the event stream trims; the dead letters stay
    assert tq.num_dead_letters(P) == 3

    dead = reader.dead_letters()
    added = tq.redrive_dead_letters(P, [dead[0].id])
    assert len(added) == 1 and tq.num_dead_letters(P) == 2
    again = [e for e in reader.read(count=100, block_s=0.1) if "redriven_from" in e.extra]
    assert [(e.key, e.extra["redriven_from"]) for e in again] == [("g0", dead[0].id)]
    assert "dead_group" not in again[0].extra and again[0].to_status == "pending"
    with pytest.raises(Exception, match="dead letter 0-1"):
        tq.redrive_dead_letters(P, ["0-1"])


def test_a_service_refuses_a_redis_without_aof_unless_durability_is_off(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis", extra_args=("--appendonly", "no"))
    server.start()
    try:
        with pytest.raises(DurabilityError, match="appendonly=no"):
            TransferQueue(server.client()).check_durability()
        TransferQueue(server.client(), durability="off").check_durability()
        config = {
            "tq": {"url": server.url, "partitions": []},
            "tq_scorer": {"enabled": True, "partitions": [P]},
        }
        reward = ServiceProcess("relayrl-reward", config, tmp_path / "reward")
        with pytest.raises(RuntimeError, match="relayrl-reward exited 1"):
            reward.start(timeout_s=60)
        log = reward.log()
        assert "appendonly=no" in log and "Traceback" not in log, log
        config["tq"]["durability"] = "off"  # type: ignore[index]
        with ServiceProcess("relayrl-reward", config, tmp_path / "reward-off") as accepted:
            assert accepted.alive()
    finally:
        server.stop()
