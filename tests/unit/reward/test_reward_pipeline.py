"""The pipeline's logic with in-process managers: ordering, chunking, micro-batching,
back-pressure, deadlines, failures as statuses. (The same paths run against real processes
in tests/integration/reward.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from relayrl.reward.items import (
    InfraError,
    RewardItem,
    ScoringTimeout,
    Status,
    Verdict,
)
from relayrl.reward.managers.base import BatchingConfig, Outcome, RewardManager
from relayrl.reward.metrics import RewardMetrics
from relayrl.reward.pipeline import (
    InvalidRequest,
    Overloaded,
    PipelineSettings,
    RewardPipeline,
    SubmitOptions,
    UnknownHandle,
)


class Recorder(RewardManager):
    """Scores len(response); records every call; optional per-call delay or behaviour."""

    supports_batch = True

    def __init__(
        self,
        name: str = "rec",
        delay_s: float | Callable[[Sequence[RewardItem]], float] = 0.0,
        behaviour: Callable[[RewardItem], Awaitable[Outcome] | Outcome] | None = None,
    ) -> None:
        super().__init__(name)
        self.calls: list[list[str]] = []
        self.max_concurrent_calls = 0
        self._running = 0
        self._delay_s = delay_s
        self._behaviour = behaviour

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        self.calls.append([item.item_id for item in items])
        self._running += 1
        self.max_concurrent_calls = max(self.max_concurrent_calls, self._running)
        try:
            delay = self._delay_s(items) if callable(self._delay_s) else self._delay_s
            await asyncio.sleep(delay)
            outcomes: list[Outcome] = []
            for item in items:
                if self._behaviour is None:
                    outcomes.append(Verdict(float(len(item.response))))
                else:
                    value = self._behaviour(item)
                    outcomes.append(await value if asyncio.iscoroutine(value) else value)
            return outcomes
        finally:
            self._running -= 1


def items(n: int, prefix: str = "i", **fields: Any) -> list[RewardItem]:
    return [RewardItem(f"{prefix}{k}", response="x" * k, **fields) for k in range(n)]


def run_with(
    manager: RewardManager,
    scenario: Callable[[RewardPipeline], Awaitable[Any]],
    *,
    batching: BatchingConfig | None = None,
    timeout_s: float | None = None,
    **settings: Any,
) -> Any:
    async def main() -> Any:
        pipeline = RewardPipeline(
            {manager.name: manager},
            PipelineSettings(**settings),
            RewardMetrics(CollectorRegistry()),
            batching={manager.name: batching} if batching else None,
            timeouts_s={manager.name: timeout_s},
        )
        await pipeline.start()
        try:
            return await scenario(pipeline)
        finally:
            await pipeline.close(grace_s=1.0)

    return asyncio.run(main())


OPTS = SubmitOptions("rec")


def test_results_come_back_in_input_order_even_when_scored_out_of_order() -> None:
    manager = Recorder(delay_s=lambda batch: 0.05 if batch[0].item_id == "i0" else 0.0)

    async def scenario(pipeline: RewardPipeline) -> None:
        handle = await pipeline.submit(items(8), OPTS)
        done, results = await pipeline.collect(handle.id, wait_s=5)
        assert done
        assert [r.item_id for r in results] == [f"i{k}" for k in range(8)]
        assert [r.score for r in results] == [float(k) for k in range(8)]
        assert all(r.status is Status.OK and r.manager == "rec" for r in results)

    run_with(manager, scenario, num_workers=4)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([], "items: empty"),
        ([RewardItem("a"), RewardItem("a")], "items[1].item_id: duplicate id 'a'"),
        ([RewardItem("")], "items[0].item_id: empty"),
        (
            [RewardItem("g", group_id="", extra={"group_size": "2"})],
            "items[0].group_id",
        ),
        ([RewardItem("g", group_id="x", extra={"group_size": "two"})], "not an integer"),
    ],
)
def test_malformed_submissions_are_refused_whole(batch: list[RewardItem], message: str) -> None:
    async def scenario(pipeline: RewardPipeline) -> None:
        with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
            await pipeline.submit(batch, OPTS)
        assert pipeline.num_backlog == 0

    run_with(Recorder(), scenario)


def test_unknown_manager_and_too_many_items_are_refused() -> None:
    async def scenario(pipeline: RewardPipeline) -> None:
        with pytest.raises(InvalidRequest, match="unknown manager 'nope'"):
            await pipeline.submit(items(1), SubmitOptions("nope"))
        with pytest.raises(InvalidRequest, match="5 items in one request; at most 4"):
            await pipeline.submit(items(5), OPTS)

    run_with(Recorder(), scenario, max_items_per_request=4)


def test_without_micro_batching_a_submission_is_split_across_workers() -> None:
    manager = Recorder(delay_s=0.01)

    async def scenario(pipeline: RewardPipeline) -> None:
        handle = await pipeline.submit(items(32), OPTS)
        await pipeline.wait(handle, 5)
        assert sorted(len(call) for call in manager.calls) == [16, 16]

    run_with(manager, scenario, num_workers=2)


def test_per_item_submissions_without_micro_batching_are_per_item_calls_bounded_by_workers() -> (
    None
):
    manager = Recorder(delay_s=0.02)

    async def scenario(pipeline: RewardPipeline) -> None:
        handles = [await pipeline.submit([item], OPTS) for item in items(10)]
        for handle in handles:
            await pipeline.wait(handle, 5)
        assert [len(call) for call in manager.calls] == [1] * 10
        assert manager.max_concurrent_calls == 2

    run_with(manager, scenario, num_workers=2)


def test_micro_batching_groups_per_item_arrivals_into_few_calls() -> None:
    manager = Recorder(delay_s=0.05)
    batching = BatchingConfig(micro_batch_size=8, micro_batch_timeout_ms=50, max_inflight_calls=4)

    async def scenario(pipeline: RewardPipeline) -> None:
        handles = [await pipeline.submit([item], OPTS) for item in items(16)]
        for handle in handles:
            assert await pipeline.wait(handle, 5)
        assert [len(call) for call in manager.calls] == [8, 8]

    run_with(manager, scenario, batching=batching)


def test_micro_batch_timeout_flushes_a_partial_batch() -> None:
    manager = Recorder()
    batching = BatchingConfig(micro_batch_size=16, micro_batch_timeout_ms=100)

    async def scenario(pipeline: RewardPipeline) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        handles = [await pipeline.submit([item], OPTS) for item in items(3)]
        await asyncio.sleep(0.03)
        assert manager.calls == []  # still waiting for the batch to fill
        for handle in handles:
            assert await pipeline.wait(handle, 5)
        assert manager.calls == [["i0", "i1", "i2"]]
        assert loop.time() - started >= 0.09

    run_with(manager, scenario, batching=batching)


def test_micro_batching_respects_max_inflight_calls() -> None:
    manager = Recorder(delay_s=0.05)
    batching = BatchingConfig(micro_batch_size=2, micro_batch_timeout_ms=1, max_inflight_calls=3)

    async def scenario(pipeline: RewardPipeline) -> None:
        handle = await pipeline.submit(items(20), OPTS)
        assert await pipeline.wait(handle, 5)
        assert manager.max_concurrent_calls == 3
        assert all(len(call) <= 2 for call in manager.calls)

    run_with(manager, scenario, batching=batching)


def test_block_back_pressure_waits_for_room_then_gives_up_at_the_deadline() -> None:
    release = asyncio.Event

    async def scenario(pipeline: RewardPipeline) -> None:
        gate = release()
        manager.gate = gate  # type: ignore[attr-defined]
        first = await pipeline.submit(items(4, "a"), OPTS)
        assert pipeline.num_backlog == 4
        loop = asyncio.get_running_loop()
        with pytest.raises(Overloaded, match="backlog is full"):
            await pipeline.submit(items(1, "b"), OPTS, deadline_s=loop.time() + 0.1)
        waiting = asyncio.create_task(pipeline.submit(items(2, "c"), OPTS))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # blocked, not dropped
        gate.set()
        second = await asyncio.wait_for(waiting, 5)
        assert await pipeline.wait(first, 5) and await pipeline.wait(second, 5)
        assert all(r.status is Status.OK for r in first.results() + second.results())

    async def gated(item: RewardItem) -> Outcome:
        await manager.gate.wait()  # type: ignore[attr-defined]
        return Verdict(1.0)

    manager = Recorder(behaviour=gated)
    run_with(manager, scenario, backlog_max_items=4, num_workers=4)


def test_drop_oldest_evicts_queued_items_as_rate_limited_never_silently() -> None:
    async def scenario(pipeline: RewardPipeline) -> None:
        gate = asyncio.Event()
        manager.gate = gate  # type: ignore[attr-defined]
        running = await pipeline.submit(items(1, "run"), OPTS)  # occupies the only worker
        await asyncio.sleep(0.01)
        queued = await pipeline.submit(items(3, "old"), OPTS)
        newer = await pipeline.submit(items(2, "new"), OPTS)
        evicted = [r for r in (e.future.result() for e in queued.entries if e.future.done())]
        assert [r.item_id for r in evicted] == ["old0", "old1"]
        assert all(r.status is Status.RATE_LIMITED for r in evicted)
        assert "evicted from a full backlog" in evicted[0].message
        gate.set()
        for handle in (running, queued, newer):
            assert await pipeline.wait(handle, 5)
        statuses = [r.status for r in queued.results()]
        assert statuses == [Status.RATE_LIMITED, Status.RATE_LIMITED, Status.OK]
        assert all(r.status is Status.OK for r in newer.results() + running.results())

    async def gated(item: RewardItem) -> Outcome:
        await manager.gate.wait()  # type: ignore[attr-defined]
        return Verdict(1.0)

    manager = Recorder(behaviour=gated)
    run_with(manager, scenario, backlog_max_items=4, backlog_mode="drop_oldest", num_workers=1)


def test_failures_are_statuses_never_scores() -> None:
    def behaviour(item: RewardItem) -> Outcome:
        kind = item.item_id
        if kind == "infra":
            return InfraError("judge unreachable")
        if kind == "timeout":
            return ScoringTimeout("too slow")
        if kind == "fail":
            return Verdict(0.0, Status.POLICY_FAIL, message="wrong")
        return Verdict(1.0)

    async def scenario(pipeline: RewardPipeline) -> None:
        batch = [RewardItem(k) for k in ("ok", "infra", "timeout", "fail")]
        results = await pipeline.score(batch, OPTS, None)
        assert [r.status for r in results] == [
            Status.OK,
            Status.INFRA_ERROR,
            Status.TIMEOUT,
            Status.POLICY_FAIL,
        ]
        assert results[1].message == "judge unreachable"

    run_with(Recorder(behaviour=behaviour), scenario)


class Broken(RewardManager):
    def __init__(self, mode: str) -> None:
        super().__init__("rec")
        self.mode = mode

    async def score_batch(self, items: Sequence[RewardItem]) -> list[Outcome]:
        if self.mode == "raise":
            raise RuntimeError("backend exploded")
        if self.mode == "hang":
            await asyncio.sleep(60)
        return [Verdict(1.0)]  # wrong length for more than one item


@pytest.mark.parametrize(
    ("mode", "status", "message"),
    [
        ("raise", Status.INFRA_ERROR, "RuntimeError: backend exploded"),
        ("short", Status.INFRA_ERROR, "returned 1 outcomes for 3 items"),
        ("hang", Status.TIMEOUT, "exceeded timeout_s=0.1"),
    ],
)
def test_a_broken_manager_fails_its_items_with_a_status(
    mode: str, status: Status, message: str
) -> None:
    async def scenario(pipeline: RewardPipeline) -> None:
        results = await pipeline.score(items(3), OPTS, None)
        assert {r.status for r in results} == {status}
        assert message in results[0].message

    run_with(Broken(mode), scenario, num_workers=1, timeout_s=0.1)


def test_deadline_returns_unfinished_items_as_timeout() -> None:
    manager = Recorder(delay_s=lambda batch: 5.0 if batch[0].item_id == "i1" else 0.0)

    async def scenario(pipeline: RewardPipeline) -> None:
        loop = asyncio.get_running_loop()
        results = await pipeline.score(items(2), OPTS, loop.time() + 0.2)
        assert [r.status for r in results] == [Status.OK, Status.TIMEOUT]
        assert "deadline" in results[1].message
        await asyncio.sleep(0)  # future callbacks run on the next loop iteration
        assert pipeline.num_backlog == 0  # the expired item no longer holds backlog room

    run_with(manager, scenario, num_workers=2)


def test_token_level_scores_sit_on_the_last_generated_token() -> None:
    async def scenario(pipeline: RewardPipeline) -> None:
        item = RewardItem(
            "t", response="abc", response_token_ids=(5, 6, 7, 8), response_mask=b"\x01\x01\x00\x00"
        )
        (result,) = await pipeline.score([item], SubmitOptions("rec", token_level=True), None)
        assert result.token_level_scores == (0.0, 3.0, 0.0, 0.0)
        with pytest.raises(InvalidRequest, match="token-level scores need response_token_ids"):
            await pipeline.submit([RewardItem("u")], SubmitOptions("rec", token_level=True))

    run_with(Recorder(), scenario)


class GroupRecorder(Recorder):
    group_aware = True


def test_group_aware_managers_get_whole_groups_even_when_members_arrive_apart() -> None:
    manager = GroupRecorder()
    batching = BatchingConfig(micro_batch_size=2, micro_batch_timeout_ms=1)

    async def scenario(pipeline: RewardPipeline) -> None:
        members = [RewardItem(f"g_{k}", group_id="g", extra={"group_size": "3"}) for k in range(3)]
        handles = []
        for member in members:
            handles.append(await pipeline.submit([member], OPTS))
            await asyncio.sleep(0.02)
        for handle in handles:
            assert await pipeline.wait(handle, 5)
        assert manager.calls == [["g_0", "g_1", "g_2"]]  # one call, larger than the batch size

    run_with(manager, scenario, batching=batching)


def test_a_group_that_never_completes_times_out() -> None:
    manager = GroupRecorder()
    manager.group_timeout_s = 0.1  # type: ignore[attr-defined]

    async def scenario(pipeline: RewardPipeline) -> None:
        item = RewardItem("g_0", group_id="g", extra={"group_size": "2"})
        handle = await pipeline.submit([item], OPTS)
        assert await pipeline.wait(handle, 5)
        (result,) = handle.results()
        assert result.status is Status.TIMEOUT and "stayed incomplete (1 of 2" in result.message

    run_with(manager, scenario)


def test_collect_of_unknown_handle_and_retention() -> None:
    async def scenario(pipeline: RewardPipeline) -> None:
        with pytest.raises(UnknownHandle):
            await pipeline.collect("nope", 0)
        handle = await pipeline.submit(items(2), OPTS)
        assert (await pipeline.collect(handle.id, 5))[0]
        assert (await pipeline.collect(handle.id, 0))[0]  # a retried Collect still works
        pipeline.sweep_handles(handle.collected_at + 1000)  # type: ignore[operator]
        with pytest.raises(UnknownHandle):
            await pipeline.collect(handle.id, 0)

    run_with(Recorder(), scenario, collected_retention_s=10)


def test_close_fails_what_it_cannot_finish_as_infra_error() -> None:
    async def main() -> None:
        manager = Recorder(delay_s=30)
        pipeline = RewardPipeline(
            {"rec": manager}, PipelineSettings(), RewardMetrics(CollectorRegistry())
        )
        await pipeline.start()
        handle = await pipeline.submit(items(2), OPTS)
        await pipeline.close(grace_s=0.1)
        assert {r.status for r in handle.results()} == {Status.INFRA_ERROR}
        assert "shut down" in handle.results()[0].message

    asyncio.run(main())
