"""The coordinator's decisions with the engines and the data plane played in-process: retries
and drops over a broadcast data plane, superseding versions. The real engines, service and
data planes are in tests/integration/weightsync."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.coordinator import Coordinator, SyncError
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.transports.base import TransportError, TransportSpec

METAS = [common_pb2.TensorMeta(name="w", shape=[64], dtype=common_pb2.DTYPE_BFLOAT16)]


class Replica:
    """An engine as the coordinator sees it: answers, or fails, per call."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dead = False
        self.fail_receive_rounds: set[int] = set()
        self.receives: list[dict[str, Any]] = []
        self.calls: list[str] = []

    def client(self, url: str, timeout_s: float) -> Client:
        assert url == self.url
        return Client(self)


class Client:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def worker_rpc(self, method: str, payload: dict[str, Any]) -> list[Any]:
        if self.replica.dead:
            raise ConnectionRefusedError(f"{self.replica.url} is gone")
        if method == "relayrl_ping":
            return [{"ok": True}]
        self.replica.receives.append(payload)
        spec = TransportSpec.from_json(payload["spec"])
        round_ = int(spec.transfer_id.rsplit("-", 1)[1])
        if round_ in self.replica.fail_receive_rounds:
            raise TransportError("a peer aborted", transfer_id=spec.transfer_id)
        return [{"bucket_sha256": payload["bucket_sha256"]}]

    async def pause(self, mode: str) -> None:
        self.replica.calls.append(f"pause:{mode}")

    async def reset_prefix_cache(self) -> None:
        self.replica.calls.append("reset")

    async def set_weight_version(self, version: str) -> None:
        self.replica.calls.append(f"version:{version}")

    async def resume(self) -> None:
        self.replica.calls.append("resume")

    async def close(self) -> None:
        pass


class Gateway:
    def __init__(self) -> None:
        self.drained: list[str] = []

    async def pause(self, mode: str) -> None:
        pass

    async def resume(self, version: int | None) -> None:
        pass

    async def drain(self, replica_id: str, reason: str) -> None:
        self.drained.append(replica_id)


def coordinator(replicas: list[Replica], gateway: Gateway | None = None) -> Coordinator:
    config = WeightSyncConfig.model_validate(
        {
            "bucket_size_bytes": 4096,
            "engines": {"urls": [r.url for r in replicas], "attempts": 2},
            "data_plane": {"transport": "torch_distributed", "rendezvous_port": 29999},
        }
    )
    by_url = {r.url: r for r in replicas}
    return Coordinator(
        config,
        WeightSyncMetrics(CollectorRegistry()),
        engine_factory=lambda url, timeout_s: by_url[url].client(url, timeout_s),
        gateway=gateway,
        advertise_target=lambda: "127.0.0.1:50053",
    )


async def publish_and_wait(c: Coordinator, version: int, **kwargs: Any) -> Any:
    transfer = c.publish(version, version, METAS, **kwargs)
    data = bytes(range(128))
    c.put_bucket(transfer.transfer_id, 0, data, hashlib.sha256(data).hexdigest())
    await asyncio.wait_for(transfer.done.wait(), 10)
    return transfer


def test_a_replica_that_dies_mid_broadcast_is_dropped_and_the_others_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    survivor, doomed = Replica("http://a"), Replica("http://b")
    gateway = Gateway()
    sent: list[TransportSpec] = []

    def send(self: Coordinator, spec: TransportSpec, transfer: Any) -> None:
        sent.append(spec)
        if len(sent) == 1:  # the first attempt: a receiver dies mid-transfer
            doomed.dead = True
            raise TransportError("connection reset", transfer_id=spec.transfer_id)

    monkeypatch.setattr(Coordinator, "_send_buckets", send)
    survivor.fail_receive_rounds = {1}  # the sender's failure reaches it
    doomed.fail_receive_rounds = {1}

    async def main() -> Any:
        c = coordinator([survivor, doomed], gateway)
        try:
            transfer = await publish_and_wait(c, 1)
            return c, transfer
        finally:
            await c.close()

    c, transfer = asyncio.run(main())
    assert transfer.state == pb.TRANSFER_STATE_COMMITTED
    assert transfer.replica_ids == ["http://a"]  # only the replica that holds it
    assert [spec.num_receivers for spec in sent] == [2, 1]  # the retry goes to the living
    assert all(spec.rendezvous == "127.0.0.1:29999" and spec.num_senders == 1 for spec in sent)
    assert [p["receiver_rank_base"] for p in survivor.receives] == [0, 0]
    assert c.engines["http://a"].version == 1 and c.engines["http://a"].live
    assert not c.engines["http://b"].live and c.engines["http://b"].version == 0
    assert gateway.drained == ["http://b"]


def test_without_a_gateway_a_replica_is_paused_around_its_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replica = Replica("http://a")
    monkeypatch.setattr(Coordinator, "_send_buckets", lambda self, spec, transfer: None)

    async def main() -> None:
        c = coordinator([replica])
        try:
            await publish_and_wait(c, 1)
        finally:
            await c.close()

    asyncio.run(main())
    assert replica.calls == ["pause:keep", "reset", "version:1", "resume"]


def test_a_failing_replica_stays_paused_and_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    replica = Replica("http://a")
    replica.fail_receive_rounds = {1, 2}
    monkeypatch.setattr(Coordinator, "_send_buckets", lambda self, spec, transfer: None)

    async def main() -> Any:
        c = coordinator([replica])
        try:
            return await publish_and_wait(c, 1)
        finally:
            await c.close()

    transfer = asyncio.run(main())
    assert transfer.state == pb.TRANSFER_STATE_FAILED
    assert transfer.error.startswith("load: no replica loaded version 1")
    assert "resume" not in replica.calls  # never serves what it half loaded


def test_versions_go_forward_unless_a_resumed_trainer_supersedes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replica = Replica("http://a")
    monkeypatch.setattr(Coordinator, "_send_buckets", lambda self, spec, transfer: None)

    async def main() -> Coordinator:
        c = coordinator([replica])
        try:
            await publish_and_wait(c, 3)
            with pytest.raises(ValueError, match="publishes its weights with supersede"):
                c.publish(2, 2, METAS)
            await publish_and_wait(c, 2, supersede=True)
            return c
        finally:
            await c.close()

    c = asyncio.run(main())
    assert c.committed_version == 2 and c.engines["http://a"].version == 2


def test_a_sync_error_names_its_boundary() -> None:
    assert str(SyncError("load", "no replica")) == "load: no replica"
