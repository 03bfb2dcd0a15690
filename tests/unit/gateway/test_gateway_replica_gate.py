"""The gated replica pool (gateway with weight-sync): a replica enters routing only when
weight-sync resumes it at a version, and a replica that leaves (restart, failed load) comes
back through the same gate. Engines are played in-process; the real gateway, weight-sync and
vLLM engines meet in tests/integration/up (relayrl up, the chaos test)."""

from __future__ import annotations

import asyncio
from typing import Any

from relayrl.gateway.replicas import NoReplicaAvailable, ReplicaPool, ReplicaState
from relayrl.inference.client import EngineUnavailable


class Engine:
    def __init__(self) -> None:
        self.up = True
        self.label = "default"
        self.calls: list[str] = []
        self.base_url = "http://engine"

    def _alive(self) -> None:
        if not self.up:
            raise EngineUnavailable("connection refused")

    async def health(self) -> bool:
        return self.up

    async def weight_version(self) -> str:
        self._alive()
        return self.label

    async def pause(self, mode: str) -> None:
        self._alive()
        self.calls.append(f"pause:{mode}")

    async def resume(self) -> None:
        self._alive()
        self.calls.append("resume")

    async def set_weight_version(self, version: str) -> None:
        self._alive()
        self.label = version
        self.calls.append(f"version:{version}")

    async def reset_prefix_cache(self) -> None:
        self._alive()
        self.calls.append("reset")

    async def close(self) -> None:
        pass


def run(scenario: Any) -> Any:
    return asyncio.run(scenario())


def test_a_healthy_replica_waits_for_weight_sync_before_it_is_routed_to() -> None:
    engine = Engine()

    async def scenario() -> list[ReplicaState]:
        pool = ReplicaPool(gated=True)
        replica = await pool.add("engine-0", engine)  # type: ignore[arg-type]
        states = [replica.state]
        try:
            pool.pick("s")
        except NoReplicaAvailable as exc:
            assert "engine-0=loading" in str(exc)
        await pool.resume([replica], None)  # a resume without a version (the trainer's)
        states.append(replica.state)
        await pool.resume([replica], "3")  # weight-sync: it holds version 3
        states.append(replica.state)
        assert pool.pick("s") is replica and replica.weight_version == "3"
        return states

    assert run(scenario) == [ReplicaState.LOADING, ReplicaState.LOADING, ReplicaState.SERVING]
    assert engine.calls == ["version:3", "reset", "resume"]


def test_without_weight_sync_a_healthy_replica_serves_at_once() -> None:
    async def scenario() -> ReplicaState:
        pool = ReplicaPool(gated=False)
        return (await pool.add("engine-0", Engine())).state  # type: ignore[arg-type]

    assert run(scenario) is ReplicaState.SERVING


def test_a_restarted_replica_comes_back_through_the_gate() -> None:
    engine = Engine()

    async def scenario() -> list[ReplicaState]:
        pool = ReplicaPool(gated=True, unhealthy_after=1)
        replica = await pool.add("engine-0", engine)  # type: ignore[arg-type]
        await pool.resume([replica], "2")
        states = [replica.state]
        engine.up = False
        await pool.check(replica)
        states.append(replica.state)
        engine.up, engine.label = True, "default"  # back, with its initial weights
        await pool.check(replica)
        states.append(replica.state)
        return states

    assert run(scenario) == [
        ReplicaState.SERVING,
        ReplicaState.UNHEALTHY,
        ReplicaState.LOADING,  # not SERVING: it holds what it started with
    ]


def test_a_failed_load_holds_a_replica_until_weight_sync_resumes_it() -> None:
    engine = Engine()

    async def scenario() -> list[ReplicaState]:
        pool = ReplicaPool(gated=True)
        replica = await pool.add("engine-0", engine)  # type: ignore[arg-type]
        await pool.resume([replica], "1")
        paused = await pool.pause([replica], "keep")
        assert paused == [replica]
        pool.drain(replica, "load: shape mismatch", until_loaded=True)
        states = [replica.state]
        assert await pool.pause([replica], "keep") == []  # a switch does not pause it
        await pool.resume([replica], None)  # the trainer's resume leaves it out
        states.append(replica.state)
        await pool.resume([replica], "2")
        states.append(replica.state)
        return states

    assert run(scenario) == [ReplicaState.LOADING, ReplicaState.LOADING, ReplicaState.SERVING]


def test_a_replica_that_cannot_be_paused_leaves_routing_without_failing_the_others() -> None:
    alive, dead = Engine(), Engine()

    async def scenario() -> tuple[list[str], ReplicaState]:
        pool = ReplicaPool(gated=True)
        a = await pool.add("engine-0", alive)  # type: ignore[arg-type]
        b = await pool.add("engine-1", dead)  # type: ignore[arg-type]
        await pool.resume([a, b], "1")
        dead.up = False
        paused = await pool.pause(pool.replicas, "keep")
        return [r.replica_id for r in paused], b.state

    paused, state = run(scenario)
    assert paused == ["engine-0"] and state is ReplicaState.UNHEALTHY
