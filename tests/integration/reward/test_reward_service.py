"""relayrl-reward as a real process, called over real gRPC: ordering, ids, statuses,
deadlines, back-pressure, auth and quotas, bad messages, metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2
from relayrl.tq.server import RedisServer
from relayrl_testkit.helpers.reward import RewardProcess

OK, POLICY_FAIL = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_POLICY_FAIL
INFRA, TIMEOUT = common_pb2.REWARD_STATUS_INFRA_ERROR, common_pb2.REWARD_STATUS_TIMEOUT
RATE_LIMITED = common_pb2.REWARD_STATUS_RATE_LIMITED
INVALID = common_pb2.REWARD_STATUS_INVALID_INPUT

BY_ID = {
    "type": "custom",
    "path": "relayrl_testkit.helpers.reward_plugins:by_id",
    "max_concurrent": 64,
}


def base_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "managers": {"rules": {"type": "naive"}, "by_id": BY_ID},
        "default_manager": "by_id",
        "pipeline": {"num_workers": 4},
    }
    config.update(overrides)
    return config


@pytest.fixture
def start_reward(tmp_path: Path) -> Iterator[Any]:
    started: list[RewardProcess] = []

    def start(config: dict[str, Any], name: str = "reward", **kwargs: Any) -> RewardProcess:
        process = RewardProcess(tmp_path / name, config, **kwargs).start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


def item(item_id: str, response: str = "abc", **fields: Any) -> common_pb2.RewardItem:
    return common_pb2.RewardItem(item_id=item_id, response=response, **fields)


def test_score_submit_collect_keep_input_order_and_every_status(start_reward: Any) -> None:
    service = start_reward(base_config())
    ids = ["ok-1", "policy-1", "infra-1", "timeout-1", "ratelimited-1", "invalid-1", "crash-1"]
    slow = {"sleep_s": "0.2"}
    batch = [item(i, extra=slow if k == 0 else {}) for k, i in enumerate(ids)]

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            scored = await stub.Score(reward_pb2.ScoreRequest(items=batch))
            assert [r.item_id for r in scored.results] == ids
            statuses = [r.status for r in scored.results]
            assert statuses == [OK, POLICY_FAIL, INFRA, TIMEOUT, RATE_LIMITED, INVALID, INFRA]
            assert scored.results[0].score == 3.0
            assert "scorer bug" in scored.results[6].message
            submitted = await stub.Submit(reward_pb2.SubmitRequest(items=batch))
            assert submitted.num_items == len(ids)
            collected = await stub.Collect(
                reward_pb2.CollectRequest(handle=submitted.handle, wait_s=10)
            )
            assert collected.done and collected.num_pending == 0
            assert [r.item_id for r in collected.results] == ids
            managers = await stub.ListManagers(reward_pb2.ListManagersRequest())
            assert managers.default_manager == "by_id"
            assert {m.name: m.type for m in managers.managers} == {
                "rules": "naive",
                "by_id": "custom",
            }

    asyncio.run(scenario())


def test_collect_before_done_reports_pending_and_unknown_handles_are_not_found(
    start_reward: Any,
) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            submitted = await stub.Submit(
                reward_pb2.SubmitRequest(items=[item("ok-1", extra={"sleep_s": "1"})])
            )
            early = await stub.Collect(reward_pb2.CollectRequest(handle=submitted.handle))
            assert not early.done and early.num_pending == 1 and not early.results
            late = await stub.Collect(reward_pb2.CollectRequest(handle=submitted.handle, wait_s=10))
            assert late.done
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Collect(reward_pb2.CollectRequest(handle="nope"))
            assert error.value.code() is grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("items", "options", "message"),
    [
        ([item("a"), item("a")], {}, "items[1].item_id: duplicate id 'a'"),
        ([item("")], {}, "items[0].item_id: empty"),
        ([], {}, "items: empty"),
        ([item("a")], {"manager": "nope"}, "options.manager: unknown manager 'nope'"),
        ([item("a")], {"token_level": True}, "token-level scores need response_token_ids"),
        (
            [item("a", data_source="no_such_source", ground_truth="1")],
            {"manager": "rules"},
            "items[0] ('a')",
        ),
    ],
)
def test_malformed_requests_are_invalid_argument_naming_the_field(
    start_reward: Any, items: list[common_pb2.RewardItem], options: dict[str, Any], message: str
) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            for call in (stub.Score, stub.Submit):
                request_type = (
                    reward_pb2.ScoreRequest if call is stub.Score else reward_pb2.SubmitRequest
                )
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call(
                        request_type(items=items, options=reward_pb2.ScoreOptions(**options))
                    )
                assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert message in error.value.details()

    asyncio.run(scenario())


def test_on_error_raise_fails_the_call_naming_the_item(start_reward: Any) -> None:
    service = start_reward(base_config())
    raise_options = reward_pb2.ScoreOptions(on_error=reward_pb2.ON_ERROR_RAISE)

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            cases = {
                "infra-1": grpc.StatusCode.UNAVAILABLE,
                "timeout-1": grpc.StatusCode.DEADLINE_EXCEEDED,
                "ratelimited-1": grpc.StatusCode.RESOURCE_EXHAUSTED,
                "invalid-1": grpc.StatusCode.INVALID_ARGUMENT,
            }
            for item_id, code in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Score(
                        reward_pb2.ScoreRequest(
                            items=[item("ok-1"), item(item_id)], options=raise_options
                        )
                    )
                assert error.value.code() is code
                assert f"items[1] ('{item_id}')" in error.value.details()
            ok = await stub.Score(
                reward_pb2.ScoreRequest(items=[item("policy-1")], options=raise_options)
            )
            assert ok.results[0].status == POLICY_FAIL  # a wrong answer is not an error

    asyncio.run(scenario())


def test_deadline_returns_finished_items_and_the_rest_as_timeout(start_reward: Any) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            response = await stub.Score(
                reward_pb2.ScoreRequest(
                    items=[item("ok-fast"), item("ok-slow", extra={"sleep_s": "30"})]
                ),
                timeout=1.5,
            )
            assert [r.status for r in response.results] == [OK, TIMEOUT]
            assert "deadline" in response.results[1].message

    asyncio.run(scenario())


def test_score_stream_returns_each_item_as_it_is_scored(start_reward: Any) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            call = stub.ScoreStream()
            await call.write(reward_pb2.ScoreStreamRequest(options=reward_pb2.ScoreOptions()))
            await call.write(
                reward_pb2.ScoreStreamRequest(item=item("ok-slow", extra={"sleep_s": "0.5"}))
            )
            await call.write(reward_pb2.ScoreStreamRequest(item=item("infra-1")))
            first = await call.read()
            assert first.result.item_id == "infra-1"  # out of order: as scored
            assert first.result.status == INFRA
            await call.write(reward_pb2.ScoreStreamRequest(item=item("policy-1")))
            await call.done_writing()
            rest = [response.result async for response in call]
            assert {r.item_id: r.status for r in rest} == {"ok-slow": OK, "policy-1": POLICY_FAIL}
            assert await call.code() is grpc.StatusCode.OK

            dup = stub.ScoreStream()
            await dup.write(reward_pb2.ScoreStreamRequest(item=item("a")))
            await dup.write(reward_pb2.ScoreStreamRequest(item=item("a")))
            await dup.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in dup:
                    pass
            assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "message 1: item.item_id: duplicate id 'a'" in error.value.details()

    asyncio.run(scenario())


def test_block_back_pressure_refuses_at_the_deadline_and_drop_oldest_marks_evictions(
    start_reward: Any,
) -> None:
    slow = {"sleep_s": "1.5"}
    block = start_reward(
        base_config(pipeline={"num_workers": 1, "backlog": {"max_items": 2, "mode": "block"}}),
        name="block",
    )
    drop = start_reward(
        base_config(
            pipeline={"num_workers": 1, "backlog": {"max_items": 2, "mode": "drop_oldest"}}
        ),
        name="drop",
    )

    async def scenario() -> None:
        channel, stub = block.stub()
        async with channel:
            first = await stub.Submit(
                reward_pb2.SubmitRequest(items=[item("ok-1", extra=slow), item("ok-2")])
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Submit(reward_pb2.SubmitRequest(items=[item("ok-3")]), timeout=0.5)
            assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "backlog is full" in error.value.details()
            # Blocked, not dropped: with a longer deadline the same submit is accepted.
            later = await stub.Submit(reward_pb2.SubmitRequest(items=[item("ok-3")]), timeout=10)
            for handle in (first.handle, later.handle):
                done = await stub.Collect(reward_pb2.CollectRequest(handle=handle, wait_s=10))
                assert done.done and {r.status for r in done.results} == {OK}

        channel, stub = drop.stub()
        async with channel:
            running = await stub.Submit(
                reward_pb2.SubmitRequest(items=[item("ok-run", extra=slow)])
            )
            await asyncio.sleep(0.2)  # the only worker is busy with it
            old = await stub.Submit(reward_pb2.SubmitRequest(items=[item("ok-old")]))
            new = await stub.Submit(reward_pb2.SubmitRequest(items=[item("ok-new")]))
            results = {}
            for handle in (running.handle, old.handle, new.handle):
                done = await stub.Collect(reward_pb2.CollectRequest(handle=handle, wait_s=10))
                results.update({r.item_id: r for r in done.results})
            assert results["ok-old"].status == RATE_LIMITED
            assert "evicted" in results["ok-old"].message
            assert results["ok-run"].status == OK and results["ok-new"].status == OK

    asyncio.run(scenario())


def test_auth_manager_permissions_and_quotas(start_reward: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("team-a: token-aaaaaaaaaaaaaaaa\nteam-b: token-bbbbbbbbbbbbbbbb\n")
    service = start_reward(
        base_config(
            auth={"type": "static_token", "tokens_file": str(tokens)},
            tenants={
                "team-a": {"requests_per_minute": 2, "managers": ["by_id"]},
                "team-b": {"tokens_per_minute": 10},
            },
        )
    )

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Score(reward_pb2.ScoreRequest(items=[item("ok-1")]))
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
        channel, stub = service.stub("token-aaaaaaaaaaaaaaaa")
        async with channel:
            listed = await stub.ListManagers(reward_pb2.ListManagersRequest())
            assert [m.name for m in listed.managers] == ["by_id"]
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Score(
                    reward_pb2.ScoreRequest(
                        items=[item("ok-1")], options=reward_pb2.ScoreOptions(manager="rules")
                    )
                )
            assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED
            for _ in range(2):
                await stub.Score(reward_pb2.ScoreRequest(items=[item("ok-1")]))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Score(reward_pb2.ScoreRequest(items=[item("ok-1")]))
            assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "requests_per_minute" in error.value.details()
            retry_ms = dict(error.value.trailing_metadata())["retry-after-ms"]
            assert 10_000 < int(retry_ms) <= 30_000
        channel, stub = service.stub("token-bbbbbbbbbbbbbbbb")
        async with channel:
            await stub.Score(reward_pb2.ScoreRequest(items=[item("ok-1", response="x" * 32)]))
            call = stub.ScoreStream()
            await call.write(reward_pb2.ScoreStreamRequest(item=item("ok-2", response="x" * 32)))
            await call.done_writing()
            (refused,) = [response.result async for response in call]
            assert refused.status == RATE_LIMITED and "tokens_per_minute" in refused.message

    asyncio.run(scenario())


def test_replicas_sharing_redis_share_each_tenants_quota(
    start_reward: Any, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two replicas behind one Service: with quotas in Redis a tenant gets its quota once,
    not once per replica; with each replica counting alone it gets it twice. A Redis that
    does not answer refuses the call as UNAVAILABLE (an unscored item as INFRA_ERROR)."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("team-a: token-aaaaaaaaaaaaaaaa\n")

    def replicas(store: str) -> list[RewardProcess]:
        config = base_config(
            auth={"type": "static_token", "tokens_file": str(tokens)},
            tenant_defaults={"requests_per_minute": 3},
            quota_store=store,
            tq={"url": redis_server.url, "namespace": f"quota-{store}"},
        )
        return [start_reward(config, name=f"{store}-{i}") for i in range(2)]

    async def accepted(services: list[RewardProcess], calls: int) -> int:
        count = 0
        for i in range(calls):
            channel, stub = services[i % 2].stub("token-aaaaaaaaaaaaaaaa")
            async with channel:
                try:
                    await stub.Score(reward_pb2.ScoreRequest(items=[item(f"ok-{i}")]))
                    count += 1
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        return count

    shared, alone = replicas("redis"), replicas("memory")
    assert asyncio.run(accepted(shared, 8)) == 3
    assert asyncio.run(accepted(alone, 8)) == 6
    keys = redis_server.client().keys("{quota-redis}:reward:quota:*")
    assert sorted(k.decode() for k in keys) == [
        "{quota-redis}:reward:quota:team-a:requests_per_minute"
    ]
    ttl = redis_server.client().ttl(keys[0])
    assert 0 < ttl <= 61  # gone once the bucket would be full again

    redis_server.kill()

    async def without_redis() -> None:
        channel, stub = shared[0].stub("token-aaaaaaaaaaaaaaaa")
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Score(reward_pb2.ScoreRequest(items=[item("ok-x")]))
            assert error.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "quota store (Redis) did not answer" in error.value.details()
            call = stub.ScoreStream()
            await call.write(reward_pb2.ScoreStreamRequest(item=item("ok-y")))
            await call.done_writing()
            (result,) = [response.result async for response in call]
            assert result.status == INFRA and "quota store" in result.message

    asyncio.run(without_redis())


def test_malformed_and_oversized_messages_are_rejected_and_the_service_stays_up(
    start_reward: Any,
) -> None:
    service = start_reward(base_config(grpc={"max_message_bytes": 64 * 1024}))

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            raw = channel.unary_unary(
                "/relayrl.proto.reward.v1.RewardService/Score",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await raw(b"\xff\xff\xff\xff\x0f garbage")
            assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid message" in error.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Score(
                    reward_pb2.ScoreRequest(items=[item("ok-1", response="x" * 200_000)])
                )
            assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            ok = await stub.Score(reward_pb2.ScoreRequest(items=[item("ok-1")]))
            assert ok.results[0].status == OK
        assert service.alive()

    asyncio.run(scenario())


def test_metrics_report_backlog_backends_statuses_and_overlap(start_reward: Any) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            submitted = await stub.Submit(
                reward_pb2.SubmitRequest(items=[item("ok-1"), item("infra-1")])
            )
            await stub.Collect(reward_pb2.CollectRequest(handle=submitted.handle, wait_s=10))

    asyncio.run(scenario())
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in (
        'relayrl_reward_results_total{manager="by_id",status="OK",tenant="anonymous"} 1.0',
        'relayrl_reward_results_total{manager="by_id",status="INFRA_ERROR",tenant="anonymous"} 1.0',
        'relayrl_reward_items_submitted_total{manager="by_id",tenant="anonymous"} 2.0',
        'relayrl_reward_submissions_total{api="submit",tenant="anonymous"} 1.0',
        'relayrl_reward_collects_total{done="true"} 1.0',
        "relayrl_reward_backlog_items 0.0",
        "relayrl_reward_backlog_max_items 2.0",
        'relayrl_reward_backend_requests_total{manager="by_id"} 2.0',
    ):
        assert line in text, line
    assert "relayrl_reward_overlap_ratio " in text
    collect = "/relayrl.proto.reward.v1.RewardService/Collect"
    assert f'relayrl_reward_grpc_requests_total{{code="OK",method="{collect}"}} 1.0' in text


CLIENT = """
import sys, grpc
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2, reward_pb2_grpc

with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    items = [common_pb2.RewardItem(item_id=f"q{k}", data_source="gsm8k",
             response=f"so #### {k}", ground_truth="#### 2") for k in range(4)]
    response = stub.Score(reward_pb2.ScoreRequest(items=items,
        options=reward_pb2.ScoreOptions(manager="rules")), timeout=10)
    for r in response.results:
        print(r.item_id, common_pb2.RewardStatus.Name(r.status), r.score)
"""


def test_a_plain_grpcio_client_in_another_process_scores_gsm8k(start_reward: Any) -> None:
    service = start_reward(base_config())
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, service.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split("\n")[:4] == [
        "q0 REWARD_STATUS_POLICY_FAIL 0.0",
        "q1 REWARD_STATUS_POLICY_FAIL 0.0",
        "q2 REWARD_STATUS_OK 1.0",
        "q3 REWARD_STATUS_POLICY_FAIL 0.0",
    ]


def test_sigterm_finishes_accepted_work_and_exits_zero(start_reward: Any) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            call = stub.Score(
                reward_pb2.ScoreRequest(items=[item("ok-1", extra={"sleep_s": "0.5"})])
            )
            await asyncio.sleep(0.2)
            os.kill(service.pid, signal.SIGTERM)
            response = await call
            assert response.results[0].status == OK

    asyncio.run(scenario())
    assert service.process.wait(30) == 0  # type: ignore[union-attr]
    assert "Traceback" not in service.log()


def test_stream_deadline_returns_unfinished_items_as_timeout(start_reward: Any) -> None:
    service = start_reward(base_config())

    async def scenario() -> None:
        channel, stub = service.stub()
        async with channel:
            call = stub.ScoreStream(timeout=1.5)
            await call.write(reward_pb2.ScoreStreamRequest(item=item("ok-fast")))
            await call.write(
                reward_pb2.ScoreStreamRequest(item=item("ok-slow", extra={"sleep_s": "30"}))
            )
            await call.done_writing()
            results = {response.result.item_id: response.result async for response in call}
            assert results["ok-fast"].status == OK
            assert results["ok-slow"].status == TIMEOUT
            assert await call.code() is grpc.StatusCode.OK

    asyncio.run(scenario())
