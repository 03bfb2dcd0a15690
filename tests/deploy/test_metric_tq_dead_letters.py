"""The TransferQueue collector's dead-letter gauge (the series behind
RelayrlTransferQueueDeadLetters) counts what consumers really moved to a partition's dead-letter
stream, against a real redis-server."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.consumer import EventConsumer
from relayrl.tq.metrics import TQCollector

DEAD = "relayrl_trainer_tq_dead_letter_events"


def test_events_given_up_on_are_counted_per_partition(tq: TransferQueue) -> None:
    registry = CollectorRegistry()
    registry.register(TQCollector(tq, "trainer", ["train", "val"], lambda: 0))
    assert registry.get_sample_value(DEAD, {"partition": "train"}) == 0
    groups = [
        common_pb2.PromptGroup(uid=f"g{i}", num_samples=1, prompt_token_ids=[1]) for i in (0, 1)
    ]
    tq.put_groups("train", groups)
    options = {"group": "reward", "reclaim_idle_s": 0.05, "max_deliveries": 1}
    delivered = EventConsumer(tq, "train", reader="r0", **options).read(block_s=0.1)
    assert len(delivered) == 2  # read once, never acknowledged: the reader "died"
    time.sleep(0.2)
    EventConsumer(tq, "train", reader="r1", **options).read(block_s=0.1)
    assert registry.get_sample_value(DEAD, {"partition": "train"}) == 2
    assert registry.get_sample_value(DEAD, {"partition": "val"}) == 0
