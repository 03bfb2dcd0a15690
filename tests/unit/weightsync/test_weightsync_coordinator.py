"""The coordinator's decisions with the engines and the data plane played in-process: retries
with a backoff, what commits and what fails, late joiners reconciled, the committed version
read back after a restart. The gateway side is the real ReplicaPool (gated, as in a
deployment) behind the same three calls weight-sync makes, so an id the gateway does not
know, or a resume the pool would refuse, behaves as it would in production. The real
engines, service and data planes are in tests/integration/weightsync."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from relayrl.core.records import TransferRecord, read_records
from relayrl.dataplane.transports.base import TransportError, TransportSpec
from relayrl.gateway.replicas import ReplicaPool, ReplicaState
from relayrl.inference.client import EngineUnavailable
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
from relayrl.weightsync.config import WeightSyncConfig
from relayrl.weightsync.coordinator import Coordinator, SyncError
from relayrl.weightsync.metrics import WeightSyncMetrics
from relayrl.weightsync.state import CommittedStore, StateError
from relayrl.weightsync.versions import PlanMismatch

METAS = [common_pb2.TensorMeta(name="w", shape=[64], dtype=common_pb2.DTYPE_BFLOAT16)]
DATA = bytes(range(128))


class Engine:
    """An engine as weight-sync and the gateway see it: answers, or fails, per call; its one
    worker remembers what it holds as the real worker extension does."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dead = False
        self.refuse = False  # answers, but every load fails
        self.load_s = 0.0  # how long a load takes before it answers
        self.fail_receive_rounds: set[int] = set()
        self.holds: str | None = ""
        self.label = "default"
        self.receives: list[dict[str, Any]] = []
        self.calls: list[str] = []
        # The worker's pull of a gRPC transfer: the bucket digests it loaded (None: it takes
        # the request's, or DATA's).
        self.pull: Callable[[dict[str, Any]], Awaitable[list[str]]] | None = None

    def client(self, url: str = "", timeout_s: float = 0.0) -> Client:
        return Client(self)


class Client:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.base_url = engine.url

    def _alive(self) -> None:
        if self.engine.dead:
            raise EngineUnavailable(f"{self.engine.url} is gone")

    async def worker_rpc(self, method: str, payload: dict[str, Any]) -> list[Any]:
        self._alive()
        if method == "relayrl_ping":
            return [{"ok": True, "holds": self.engine.holds}]
        self.engine.receives.append(payload)
        self.engine.holds = None
        if self.engine.load_s:
            await asyncio.sleep(self.engine.load_s)
        if self.engine.refuse:
            raise EngineUnavailable("load_weights failed: shape mismatch")
        if "spec" in payload:
            spec = TransportSpec.from_json(payload["spec"])
            round_ = int(spec.transfer_id.rsplit("-", 1)[1])
            if round_ in self.engine.fail_receive_rounds:
                raise TransportError("a peer aborted", transfer_id=spec.transfer_id)
        if self.engine.pull is not None:
            sha256 = await self.engine.pull(payload)
        else:
            sha256 = payload.get("bucket_sha256") or [hashlib.sha256(DATA).hexdigest()]
        self.engine.holds = payload["transfer_id"]
        return [{"bucket_sha256": sha256}]

    async def health(self) -> bool:
        return not self.engine.dead

    async def weight_version(self) -> str:
        self._alive()
        return self.engine.label

    async def pause(self, mode: str) -> None:
        self._alive()
        self.engine.calls.append(f"pause:{mode}")

    async def reset_prefix_cache(self) -> None:
        self._alive()
        self.engine.calls.append("reset")

    async def set_weight_version(self, version: str) -> None:
        self._alive()
        self.engine.label = version
        self.engine.calls.append(f"version:{version}")

    async def resume(self) -> None:
        self._alive()
        self.engine.calls.append("resume")

    async def close(self) -> None:
        pass


class PoolGateway:
    """weight-sync's GatewayControl calls, answered by a real gated ReplicaPool."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        self.pool = ReplicaPool(gated=True)
        self.engines = engines

    async def join(self) -> None:
        for replica_id, engine in self.engines.items():
            await self.pool.add(replica_id, engine.client())

    def state(self, replica_id: str) -> ReplicaState:
        return self.pool.get(replica_id).state

    async def pause(self, mode: str, replica_ids: Any = ()) -> list[str]:
        replicas = self.pool.select(list(replica_ids))  # KeyError: NOT_FOUND, as the servicer
        return [r.replica_id for r in await self.pool.pause(replicas, mode)]  # type: ignore[arg-type]

    async def resume(self, replica_id: str, version: int) -> bool:
        try:
            replicas = self.pool.select([replica_id])
        except KeyError:
            return False
        await self.pool.resume(replicas, str(version))
        return True

    async def hold(self, replica_id: str, reason: str) -> None:
        try:
            (replica,) = self.pool.select([replica_id])
        except KeyError:
            return
        self.pool.drain(replica, reason, until_loaded=True)


def coordinator(
    engines: dict[str, Engine],
    gateway: PoolGateway | None = None,
    *,
    transport: str = "torch_distributed",
    state_dir: Path | None = None,
    static: bool = True,
    backoff_s: float = 0.0,
    cut_through: bool = True,
    transfer_timeout_s: float = 600.0,
    metrics_log: Path | None = None,
) -> Coordinator:
    config = WeightSyncConfig.model_validate(
        {
            "bucket_size_bytes": 4096,
            "engines": {
                "urls": [e.url for e in engines.values()] if static else [],
                "attempts": 2,
                "retry_backoff_s": backoff_s,
            },
            "data_plane": {
                "transport": transport,
                "rendezvous_port": 29999,
                "cut_through": cut_through,
            },
            "state_dir": str(state_dir) if state_dir else None,
            "transfer_timeout_s": transfer_timeout_s,
            "metrics_log": str(metrics_log) if metrics_log else None,
        }
    )
    by_url = {e.url: e for e in engines.values()}
    return Coordinator(
        config,
        WeightSyncMetrics(CollectorRegistry()),
        engine_factory=lambda url, timeout_s: by_url[url].client(url, timeout_s),
        gateway=gateway,
        advertise_target=lambda: "127.0.0.1:50053",
    )


async def publish_and_wait(c: Coordinator, version: int, **kwargs: Any) -> Any:
    transfer = c.publish(version, version, METAS, **kwargs)
    c.put_bucket(transfer.transfer_id, 0, DATA, hashlib.sha256(DATA).hexdigest())
    await asyncio.wait_for(transfer.done.wait(), 10)
    return transfer


async def settle(c: Coordinator) -> None:
    """Until no reconciliation runs."""
    for _ in range(500):
        await asyncio.sleep(0.01)
        if not any(e.reconciling for e in c.engines.values()):
            return
    raise AssertionError("a reconciliation did not finish")


async def registered_by_a_gateway(engine: Engine, **kwargs: Any) -> tuple[PoolGateway, Coordinator]:
    """A gRPC-plane coordinator whose one replica, engine-0, a gateway registered and routes
    to."""
    gateway = PoolGateway({"engine-0": engine})
    await gateway.join()
    c = coordinator({"engine-0": engine}, gateway, transport="grpc", static=False, **kwargs)
    c.register_engine("engine-0", engine.url, 0)
    await settle(c)
    return gateway, c


async def registers_again(
    c: Coordinator, gateway: PoolGateway, engine: Engine, version: int
) -> ReplicaState:
    """The gateway's next registration of engine-0 (not routed to), once reconciled."""
    c.register_engine("engine-0", engine.url, version, routed=False)
    await settle(c)
    return gateway.state("engine-0")


def no_send(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Coordinator, "_send_buckets", lambda self, spec, transfer: None)


def test_a_replica_that_dies_mid_broadcast_is_held_and_the_others_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    survivor, doomed = Engine("http://a"), Engine("http://b")
    engines = {"engine-0": survivor, "engine-1": doomed}
    sent: list[TransportSpec] = []

    def send(self: Coordinator, spec: TransportSpec, transfer: Any) -> None:
        sent.append(spec)
        if len(sent) == 1:  # the first attempt: a receiver dies mid-transfer
            doomed.dead = True
            raise TransportError("connection reset", transfer_id=spec.transfer_id)

    monkeypatch.setattr(Coordinator, "_send_buckets", send)
    survivor.fail_receive_rounds = {1}  # the sender's failure reaches every receiver
    doomed.fail_receive_rounds = {1}

    async def main() -> Any:
        gateway = PoolGateway(engines)
        await gateway.join()
        c = coordinator(engines, gateway)
        try:
            await gateway.resume("engine-0", 0)  # both serve their initial weights
            await gateway.resume("engine-1", 0)
            transfer = await publish_and_wait(c, 1)
            return c, gateway, transfer
        finally:
            await c.close()

    c, gateway, transfer = asyncio.run(main())
    assert transfer.state == pb.TRANSFER_STATE_COMMITTED
    assert transfer.replica_ids == ["engine-0"]  # only the replica that holds it
    assert [spec.num_receivers for spec in sent] == [2, 1]  # the retry goes to the living
    assert all(spec.rendezvous == "127.0.0.1:29999" and spec.num_senders == 1 for spec in sent)
    assert [p["receiver_rank_base"] for p in survivor.receives] == [0, 0]
    assert c.engines["engine-0"].version == 1
    assert c.engines["engine-0"].holds == transfer.transfer_id
    assert c.engines["engine-1"].failed and c.engines["engine-1"].holds is None
    assert gateway.state("engine-0") is ReplicaState.SERVING
    assert gateway.pool.get("engine-0").weight_version == "1"
    # out of routing until it is reloaded: not drained for good, not resumable without a version
    assert gateway.state("engine-1") is ReplicaState.LOADING


def test_without_a_gateway_a_replica_is_paused_around_its_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)

    async def main() -> None:
        c = coordinator({"engine-0": engine})
        try:
            await publish_and_wait(c, 1)
        finally:
            await c.close()

    asyncio.run(main())
    assert engine.calls == ["pause:keep", "version:loading-1", "reset", "version:1", "resume"]


def test_every_finished_transfer_is_one_transfer_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)
    log = tmp_path / "weightsync" / "transfers.jsonl"

    async def main() -> None:
        c = coordinator({"engine-0": engine}, metrics_log=log)
        try:
            await publish_and_wait(c, 1)
            engine.refuse = True
            await publish_and_wait(c, 2)
        finally:
            await c.close()

    asyncio.run(main())
    committed, failed = read_records(log, TransferRecord)
    assert (committed.version, committed.trainer_step, committed.state) == (1, 1, "committed")
    assert (committed.replicas, committed.error, committed.transport) == (
        ["engine-0"], "", "torch_distributed",
    )  # fmt: skip
    assert committed.bytes > 0 and committed.durations_s
    assert (failed.version, failed.state) == (2, "failed")
    assert failed.error.startswith("load: no replica loaded version 2")
    assert sorted(json.loads(log.read_text().splitlines()[0])) == [
        "bytes", "durations_s", "error", "replicas", "state", "time", "trainer_step",
        "transport", "version",
    ]  # fmt: skip


def test_a_version_every_replica_refuses_fails_and_the_replica_is_never_resumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine("http://a")
    engine.refuse = True
    no_send(monkeypatch)

    async def main() -> Any:
        c = coordinator({"engine-0": engine}, transport="grpc")
        try:
            return await publish_and_wait(c, 1)
        finally:
            await c.close()

    transfer = asyncio.run(main())
    assert transfer.state == pb.TRANSFER_STATE_FAILED
    assert transfer.error.startswith("load: no replica loaded version 1")
    assert "engine-0 answered but could not load it" in transfer.error
    assert "resume" not in engine.calls  # never serves what it half loaded
    assert engine.label == "loading-1"  # and its own label says it holds no version


def test_a_version_commits_while_its_only_engine_restarts_and_the_engine_is_loaded_on_return(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)

    async def main() -> tuple[Any, ...]:
        gateway = PoolGateway({"engine-0": engine})
        await gateway.join()
        c = coordinator({"engine-0": engine}, gateway, transport="grpc", static=False)
        try:
            c.register_engine("engine-0", engine.url, 0)
            await settle(c)
            assert gateway.state("engine-0") is ReplicaState.SERVING  # initial weights: v0
            engine.dead = True  # killed: every attempt finds it gone
            transfer = await publish_and_wait(c, 1)
            held = gateway.state("engine-0")
            engine.dead, engine.holds, engine.label = False, "", "default"  # back, from disk
            c.register_engine("engine-0", engine.url, 0, routed=False)
            await settle(c)
            return transfer, held, c.engines["engine-0"]
        finally:
            await c.close()

    transfer, held, entry = asyncio.run(main())
    assert transfer.state == pb.TRANSFER_STATE_COMMITTED and transfer.replica_ids == []
    assert held is ReplicaState.LOADING
    assert entry.holds == transfer.transfer_id and entry.version == 1 and not entry.failed
    assert engine.label == "1" and engine.calls[-2:] == ["reset", "resume"]


def test_a_registered_replica_that_holds_the_committed_version_is_resumed_without_a_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)

    async def main() -> tuple[Any, ...]:
        first = PoolGateway({"engine-0": engine})
        await first.join()
        c = coordinator({"engine-0": engine}, first, transport="grpc", static=False)
        try:
            c.register_engine("engine-0", engine.url, 0)
            await settle(c)
            transfer = await publish_and_wait(c, 1)
            loads = len(engine.receives)
            # the gateway restarts: its replicas start out of routing, and register again
            second = PoolGateway({"engine-0": engine})
            await second.join()
            c._gateway = second
            before = second.state("engine-0")
            c.register_engine("engine-0", engine.url, 1, routed=False)
            await settle(c)
            return transfer, loads, before, second.state("engine-0")
        finally:
            await c.close()

    _, loads, before, after = asyncio.run(main())
    assert loads == 1 and len(engine.receives) == 1  # confirmed from what the engine holds
    assert before is ReplicaState.LOADING and after is ReplicaState.SERVING


def test_a_replica_down_for_its_first_try_loads_on_a_later_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        engine.dead = False  # it came back during the backoff
        await real_sleep(0)

    monkeypatch.setattr("relayrl.weightsync.coordinator.asyncio.sleep", sleep)

    async def main() -> Any:
        c = coordinator({"engine-0": engine}, transport="grpc", backoff_s=3.0)
        try:
            engine.dead = True
            return await publish_and_wait(c, 1)
        finally:
            await c.close()

    transfer = asyncio.run(main())
    assert transfer.state == pb.TRANSFER_STATE_COMMITTED and transfer.replica_ids == ["engine-0"]
    assert waits == [3.0]


def test_a_restarted_coordinator_reads_the_committed_version_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kept, fresh = Engine("http://a"), Engine("http://b")
    engines = {"engine-0": kept, "engine-1": fresh}
    no_send(monkeypatch)

    async def main() -> tuple[Any, ...]:
        c = coordinator({"engine-0": kept}, transport="grpc", state_dir=tmp_path)
        try:
            transfer = await publish_and_wait(c, 3)
        finally:
            await c.close()
        restarted = coordinator(engines, transport="grpc", state_dir=tmp_path, static=False)
        try:
            restarted.register_engine("engine-0", kept.url, 3)
            restarted.register_engine("engine-1", fresh.url, 0)
            await settle(restarted)
            return transfer, restarted
        finally:
            await restarted.close()

    transfer, restarted = asyncio.run(main())
    assert restarted.committed is not None
    assert (restarted.committed_version, restarted.committed_id) == (3, transfer.transfer_id)
    assert restarted.committed.buckets == [DATA]
    assert len(kept.receives) == 1  # it holds the committed transfer: nothing to load
    assert fresh.holds == transfer.transfer_id  # loaded from the state read back
    assert restarted.engines["engine-1"].version == 3


def test_a_version_that_cannot_be_kept_fails_and_its_replicas_are_held_until_reloaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)
    saves: list[int] = []
    real_stage = CommittedStore.stage

    def stage(self: CommittedStore, **kwargs: Any) -> str:
        saves.append(kwargs["version"])
        if kwargs["version"] == 2:
            raise OSError(28, "No space left on device")
        return real_stage(self, **kwargs)

    monkeypatch.setattr(CommittedStore, "stage", stage)

    async def main() -> tuple[Any, ...]:
        gateway, c = await registered_by_a_gateway(engine, state_dir=tmp_path)
        try:
            first = await publish_and_wait(c, 1)
            second = await publish_and_wait(c, 2)
            held = gateway.state("engine-0")
            # even routed to by mistake meanwhile, it is paused before its reload
            await gateway.resume("engine-0", 2)
            return first, second, held, await registers_again(c, gateway, engine, 1), c
        finally:
            await c.close()

    first, second, held, after, c = asyncio.run(main())
    assert second.state == pb.TRANSFER_STATE_FAILED
    assert second.error.startswith("restore: cannot keep version 2") and saves == [1, 2]
    assert c.committed_version == 1 and c.committed_id == first.transfer_id
    assert held is ReplicaState.LOADING  # it held version 2, which never committed
    # the next registration reloads the committed version 1 into it
    assert engine.holds == first.transfer_id and after is ReplicaState.SERVING
    assert engine.label == "1"


def test_a_damaged_state_dir_is_refused_with_what_to_do(tmp_path: Path) -> None:
    store = CommittedStore(tmp_path)
    plan = pb.BucketPlan(
        buckets=[
            pb.Bucket(
                index=0,
                size_bytes=len(DATA),
                tensors=[
                    common_pb2.TensorMeta(
                        name="w",
                        shape=[64],
                        dtype=common_pb2.DTYPE_BFLOAT16,
                        size_bytes=128,
                        total_bytes=128,
                    )
                ],
            )
        ]
    )
    folder = store.stage(
        version=2, trainer_step=2, transfer_id="v2-abc", metas=METAS, plan=plan, buckets=[DATA]
    )
    store.point(
        version=2,
        trainer_step=2,
        transfer_id="v2-abc",
        folder=folder,
        plan=plan,
        sha256=[hashlib.sha256(DATA).hexdigest()],
    )
    assert store.load() is not None and store.load().buckets == [DATA]  # type: ignore[union-attr]
    (tmp_path / "v2-v2-abc" / "bucket-00000.bin").write_bytes(b"x" * 128)
    with pytest.raises(StateError, match=r"bucket 0 fails its checksum; move .* away"):
        store.load()


def test_versions_go_forward_unless_a_resumed_trainer_supersedes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine("http://a")
    no_send(monkeypatch)

    async def main() -> Coordinator:
        c = coordinator({"engine-0": engine})
        try:
            await publish_and_wait(c, 3)
            with pytest.raises(ValueError, match="publishes its weights with supersede"):
                c.publish(2, 2, METAS)
            await publish_and_wait(c, 2, supersede=True)
            return c
        finally:
            await c.close()

    c = asyncio.run(main())
    assert c.committed_version == 2 and c.engines["engine-0"].version == 2


def test_a_delta_bucket_is_rebuilt_from_the_committed_version_it_was_made_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relayrl.dataplane import delta

    engine = Engine("http://a")
    no_send(monkeypatch)
    new = bytes([DATA[0] ^ 1]) + DATA[1:]  # one weight changed
    patch = delta.encode(DATA, new)
    assert patch is not None and len(patch) < len(DATA)

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    async def main() -> tuple[Any, ...]:
        c = coordinator({"engine-0": engine})
        try:
            base = await publish_and_wait(c, 1)
            # a base that is not the committed version is refused: every bucket in full
            stale = c.publish(2, 2, METAS, base_transfer_id="v0-gone")
            assert stale.plan_proto(4096, "grpc").delta_base_transfer_id == ""
            with pytest.raises(PlanMismatch, match="accepted no delta base; push it in full"):
                c.put_bucket(stale.transfer_id, 0, patch, sha(new), delta=True)
            c._versions.fail(stale, SyncError("transport", "given up by the test"))
            second = c.publish(3, 3, METAS, base_transfer_id=base.transfer_id)
            assert c.plan_proto(second).delta_base_transfer_id == base.transfer_id
            # a delta that does not rebuild what the sender exported is caught by its sha256
            with pytest.raises(SyncError, match="checksum mismatch"):
                c.put_bucket(second.transfer_id, 0, patch, sha(DATA), delta=True)
            with pytest.raises(SyncError, match="does not fit its base"):
                c.put_bucket(second.transfer_id, 0, patch[:-1], sha(new), delta=True)
            third = c.publish(4, 4, METAS, base_transfer_id=base.transfer_id)
            c.put_bucket(third.transfer_id, 0, patch, sha(new), delta=True)
            await asyncio.wait_for(third.done.wait(), 10)
            return base, third, c
        finally:
            await c.close()

    base, third, c = asyncio.run(main())
    assert c.committed_version == 4 and third.buckets == [new] and third.sha256 == [sha(new)]
    assert third.delta_base is None and base.buckets == [None]  # nothing kept past the commit


THREE_BUCKETS = [common_pb2.TensorMeta(name="w", shape=[3 * 2048], dtype=common_pb2.DTYPE_BFLOAT16)]
BUCKETS = [bytes([i]) * 4096 for i in range(3)]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pulling_worker(c: Coordinator, engine: Engine, pulled: list[int]) -> None:
    """The engine's worker pulls each bucket through the coordinator, as PullBuckets does."""

    async def pull(payload: dict[str, Any]) -> list[str]:
        transfer = c.transfer(payload["transfer_id"])
        digests = []
        for index in range(len(transfer.layouts)):
            data = await c.bucket(transfer, index)
            pulled.append(index)
            digests.append(sha(data))
        return digests

    engine.pull = pull


@pytest.mark.parametrize("cut_through", [True, False])
def test_cut_through_a_replica_pulls_each_bucket_as_it_arrives(cut_through: bool) -> None:
    engine = Engine("http://a")
    pulled: list[int] = []

    async def main() -> tuple[list[list[int]], Any, Coordinator]:
        c = coordinator({"engine-0": engine}, transport="grpc", cut_through=cut_through)
        pulling_worker(c, engine, pulled)
        try:
            transfer = c.publish(1, 1, THREE_BUCKETS)
            assert len(transfer.layouts) == 3
            seen = []
            for index, data in enumerate(BUCKETS):
                c.put_bucket(transfer.transfer_id, index, data, sha(data))
                await asyncio.sleep(0.05)
                seen.append(list(pulled))
                if index < 2:
                    assert not transfer.done.is_set()  # it commits after the last bucket
            await asyncio.wait_for(transfer.done.wait(), 10)
            return seen, transfer, c
        finally:
            await c.close()

    seen, transfer, c = asyncio.run(main())
    if cut_through:  # the switch started at the first bucket; each was pulled as it came
        assert seen == [[0], [0, 1], [0, 1, 2]]
    else:  # the switch started once the version was complete
        assert seen == [[], [], [0, 1, 2]]
    assert c.committed_version == 1 and engine.holds == transfer.transfer_id
    assert engine.calls[:2] == ["pause:keep", "version:loading-1"] and engine.label == "1"


def test_cut_through_a_push_that_dies_half_way_fails_the_version_without_retries() -> None:
    engine = Engine("http://a")
    pulled: list[int] = []

    async def main() -> tuple[Any, ...]:
        gateway, c = await registered_by_a_gateway(engine, transfer_timeout_s=0.5)
        try:
            first = await publish_and_wait(c, 1)
            pulling_worker(c, engine, pulled)
            second = c.publish(2, 2, THREE_BUCKETS)
            c.put_bucket(second.transfer_id, 0, BUCKETS[0], sha(BUCKETS[0]))  # then the sender dies
            await asyncio.wait_for(second.done.wait(), 10)
            for _ in range(200):  # the switch ends after the transfer failed
                if gateway.state("engine-0") is not ReplicaState.PAUSED:
                    break
                await asyncio.sleep(0.01)
            held = gateway.state("engine-0")
            engine.pull = None
            return first, second, held, await registers_again(c, gateway, engine, 1), c
        finally:
            await c.close()

    first, second, held, after, c = asyncio.run(main())
    assert second.state == pb.TRANSFER_STATE_FAILED
    assert second.error.startswith("transport: ") and "did not arrive within" in second.error
    assert pulled == [0]  # its first bucket was loaded: the replica held a mix
    assert [r["transfer_id"] for r in engine.receives].count(second.transfer_id) == 1  # no retry
    assert c.committed_version == 1 and held is ReplicaState.LOADING
    # the next registration reloads the committed version 1 into it
    assert engine.holds == first.transfer_id and after is ReplicaState.SERVING


def test_a_sync_error_names_its_boundary() -> None:
    assert str(SyncError("load", "no replica")) == "load: no replica"


def test_a_version_staged_on_disk_during_a_load_that_fails_is_removed_and_never_pointed_at(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The committed version is written to state_dir while the replicas load it; when no
    replica loads it, the staged folder goes and committed.json still names the last one --
    also when the write is still running (a thread, which cannot be cancelled) as the load
    fails, as a slow disk makes it here."""
    engine = Engine("http://a")
    no_send(monkeypatch)
    stage = CommittedStore.stage

    def slow_stage(self: CommittedStore, **kwargs: Any) -> str:
        import time

        time.sleep(1.0)
        return stage(self, **kwargs)

    monkeypatch.setattr(CommittedStore, "stage", slow_stage)

    async def main() -> tuple[Any, Any]:
        c = coordinator({"engine-0": engine}, transport="grpc", state_dir=tmp_path)
        try:
            first = await publish_and_wait(c, 1)
            engine.refuse, engine.load_s = True, 0.2  # fails while the write runs
            second = await publish_and_wait(c, 2)
            return first, second
        finally:
            await c.close()

    first, second = asyncio.run(main())
    assert first.state == pb.TRANSFER_STATE_COMMITTED
    assert second.state == pb.TRANSFER_STATE_FAILED
    assert second.error.startswith("load: no replica loaded version 2")
    pointer = json.loads((tmp_path / "committed.json").read_text())
    assert (pointer["version"], pointer["transfer_id"]) == (1, first.transfer_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "committed.json",
        f"v1-{first.transfer_id}",
    ]
