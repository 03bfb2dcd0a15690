"""Every built-in manager type behind the real gRPC service: judges against a real HTTP judge
process, the sandbox under attack (the service stays up), and the composite managers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2
from relayrl_testkit.helpers.reward import RewardProcess
from relayrl_testkit.judge_launcher import JudgeSimProcess, start_judge_sim

OK, POLICY_FAIL = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_POLICY_FAIL
INFRA = common_pb2.REWARD_STATUS_INFRA_ERROR


@pytest.fixture
def judge() -> Iterator[JudgeSimProcess]:
    sim = start_judge_sim(step_s=0.001, prefill_s=0.01, verdict_tokens=8)
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture
def service(judge: JudgeSimProcess, tmp_path: Path) -> Iterator[RewardProcess]:
    config: dict[str, Any] = {
        "managers": {
            "rules": {"type": "naive"},
            "genrm": {"type": "genrm", "base_url": judge.url, "model": "judge"},
            "remote": {"type": "remote", "base_url": judge.url, "model": "judge"},
            "disrm": {
                "type": "disrm",
                "base_url": judge.url,
                "model": "judge",
                "input_template": "ANSWER: {response}\nREFERENCE: {ground_truth}",
            },
            "unreachable": {
                "type": "genrm",
                "base_url": "http://127.0.0.1:9",
                "model": "judge",
                "max_retries": 0,
            },
            "sandbox": {"type": "sandbox", "time_limit_s": 2, "max_concurrent": 2},
            "dapo": {
                "type": "dapo",
                "inner": "rules",
                "max_response_length": 8,
                "overlong_buffer_length": 4,
            },
            "gdpo": {
                "type": "gdpo",
                "components": {"correct": {"manager": "rules"}, "judge": {"manager": "disrm"}},
            },
            "limited": {"type": "rate_limited", "inner": "genrm", "requests_per_minute": 1000},
            "reasoning_gym": {"type": "reasoning_gym"},
            "env": {"type": "env"},
            "env_and_rules": {"type": "env", "add": "rules"},
        },
        "default_manager": "rules",
        "pipeline": {"num_workers": 2},
    }
    process = RewardProcess(tmp_path / "svc", config).start()
    try:
        yield process
    finally:
        process.kill()


def score(
    service: RewardProcess, manager: str, items: list[common_pb2.RewardItem], **options: Any
) -> list[common_pb2.RewardResult]:
    async def call() -> list[common_pb2.RewardResult]:
        channel, stub = service.stub()
        async with channel:
            request = reward_pb2.ScoreRequest(
                items=items, options=reward_pb2.ScoreOptions(manager=manager, **options)
            )
            return list((await stub.Score(request, timeout=60)).results)

    return asyncio.run(call())


def qa(item_id: str, answer: str, reference: str = "42", **fields: Any) -> common_pb2.RewardItem:
    return common_pb2.RewardItem(
        item_id=item_id, prompt="What is 6*7?", response=answer, ground_truth=reference, **fields
    )


def test_judges_score_through_the_service(service: RewardProcess, judge: JudgeSimProcess) -> None:
    items = [qa("right", "42"), qa("wrong", "41"), qa("right2", "42"), qa("wrong2", "4")]
    for manager in ("genrm", "remote", "limited"):
        judge.reset_stats()
        results = score(service, manager, items)
        assert [(r.status, r.score) for r in results] == [(OK, 1.0), (POLICY_FAIL, 0.0)] * 2
        # Two workers: two chunks of two items; a batching judge gets one request per chunk.
        expected = [1, 1, 1, 1] if manager == "remote" else [2, 2]
        assert judge.stats()["request_items"] == expected, manager
    right, wrong = score(service, "disrm", [qa("right", "42"), qa("wrong", "41")])
    assert right.score == pytest.approx(0.92) and wrong.score == pytest.approx(0.08)
    (down,) = score(service, "unreachable", [qa("x", "42")])
    assert down.status == INFRA and down.message  # the judge being down is not a reward of 0


SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
ATTACKS = {
    "loop": "def add(a, b):\n    while True:\n        pass",
    "memory": "def add(a, b):\n    x = bytearray(10**10)\n    return a + b",
    "fork": "import os\ndef add(a, b):\n    os.fork()\n    return a + b",
    "network": (
        "import socket\n"
        "def add(a, b):\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "    return a + b"
    ),
}


def test_sandbox_attacks_end_as_statuses_and_the_service_stays_up(service: RewardProcess) -> None:
    items = [
        common_pb2.RewardItem(item_id="good", response=SOLUTION, extra={"tests": TESTS}),
        common_pb2.RewardItem(
            item_id="wrong", response="def add(a, b):\n    return a - b", extra={"tests": TESTS}
        ),
    ] + [
        common_pb2.RewardItem(item_id=name, response=code, extra={"tests": TESTS})
        for name, code in ATTACKS.items()
    ]
    results = {r.item_id: r for r in score(service, "sandbox", items)}
    assert results["good"].status == OK and results["good"].score == 1.0
    for name in ("wrong", *ATTACKS):
        assert results[name].status == POLICY_FAIL, (name, results[name])
        assert results[name].score == 0.0
    assert service.alive()
    (again,) = score(service, "sandbox", items[:1])
    assert again.status == OK


def test_dapo_and_gdpo_compose_configured_managers(service: RewardProcess) -> None:
    short = qa("short", "#### 42", data_source="gsm8k", response_token_ids=[1] * 4)
    long = qa("long", "#### 42", data_source="gsm8k", response_token_ids=[1] * 6)
    results = score(service, "dapo", [short, long])
    assert [r.score for r in results] == pytest.approx([1.0, 0.5])
    assert results[1].components["overlong_penalty"] == pytest.approx(-0.5)

    group = [
        qa(f"g{k}", answer, data_source="gsm8k", group_id="g")
        for k, answer in enumerate(["#### 42", "#### 41", "#### 42", "#### 7"])
    ]
    results = score(service, "gdpo", group)
    assert all(r.status == OK for r in results)
    assert sum(r.score for r in results) == pytest.approx(0.0, abs=1e-6)
    assert results[0].score > 0 > results[1].score
    assert set(results[0].components) == {
        "correct",
        "correct/normalized",
        "judge",
        "judge/normalized",
    }


def test_reasoning_gym_items_are_scored_by_their_checkers(service: RewardProcess) -> None:
    """Another team scores reasoning-gym items over gRPC exactly as relayrl's trainer does."""
    import json

    import grpc

    from relayrl.tasks.reasoning_gym import ReasoningGymTask

    records = ReasoningGymTask.create("leg_counting", {}).prompts("train", 2, seed=0)

    def item(item_id: str, record: dict[str, Any], response: str) -> common_pb2.RewardItem:
        return common_pb2.RewardItem(
            item_id=item_id, data_source=record["data_source"], response=response,
            ground_truth=record["ground_truth"],
        )  # fmt: skip

    answers = [json.loads(r["ground_truth"])["answer"] for r in records]
    items = [
        item("right", records[0], f"Counting legs... <answer>{answers[0]}</answer>"),
        item("wrong", records[1], f"<answer>{int(answers[1]) + 1}</answer>"),
        item("untagged", records[1], answers[1]),
    ]
    results = score(service, "reasoning_gym", items)
    assert [(r.item_id, r.status, r.score) for r in results] == [
        ("right", OK, 1.0), ("wrong", POLICY_FAIL, 0.0), ("untagged", POLICY_FAIL, 0.0),
    ]  # fmt: skip
    malformed = item("bad", records[0], "<answer>1</answer>")
    malformed.ground_truth = "292"  # not the item's JSON: refused, never scored 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        score(service, "reasoning_gym", [malformed])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the ground truth must be the JSON" in (refused.value.details() or "")


def test_an_environment_reward_is_scored_alone_or_added_to_a_rule(service: RewardProcess) -> None:
    """The `env` manager takes what an agent reported with its close (the trajectory's
    `env_reward`, or the item's from any caller); an environment that could not score is
    INFRA_ERROR, an item that reports nothing is refused, never scored 0, and labels in
    `extra` never report one."""
    import grpc

    statuses = {
        "ok": common_pb2.ENV_REWARD_STATUS_OK,
        "fail": common_pb2.ENV_REWARD_STATUS_FAIL,
        "error": common_pb2.ENV_REWARD_STATUS_ERROR,
        "unspecified": common_pb2.ENV_REWARD_STATUS_UNSPECIFIED,
    }

    def reporting(item_id: str, answer: str, status: str, score: float = 0.0, message: str = ""):
        reward = common_pb2.EnvReward(status=statuses[status], score=score, message=message)
        return qa(item_id, answer, data_source="arith", env_reward=reward)

    items = [
        reporting("ok", "Answer: 42", "ok", 0.5),
        reporting("fail", "Answer: 41", "fail", 0.25, message="format only"),
        reporting("error", "Answer: 42", "error", message="verifier crashed"),
    ]
    alone = score(service, "env", items)
    assert [(r.status, r.score) for r in alone[:2]] == [(OK, 0.5), (POLICY_FAIL, 0.25)]
    assert alone[1].message == "format only"
    assert alone[2].status == INFRA and "verifier crashed" in alone[2].message
    added = score(service, "env_and_rules", items[:2])
    assert [(r.status, r.score) for r in added] == [(OK, 1.5), (POLICY_FAIL, 0.25)]
    assert dict(added[0].components) == {"env": 0.5, "rules": 1.0}
    posing = {"env_reward": "1.0", "env_reward_status": "ok"}
    for bad, words in (
        (qa("silent", "Answer: 42", data_source="arith"), "reports no environment reward"),
        (qa("posing", "x", data_source="arith", extra=posing), "reports no environment reward"),
        (reporting("odd", "x", "unspecified"), "malformed environment reward"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            score(service, "env", [bad])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (refused.value.details() or ""), refused.value.details()


def test_list_managers_describes_every_configured_manager(service: RewardProcess) -> None:
    async def call() -> reward_pb2.ListManagersResponse:
        channel, stub = service.stub()
        async with channel:
            return await stub.ListManagers(reward_pb2.ListManagersRequest())

    listed = {m.name: m for m in asyncio.run(call()).managers}
    assert listed["genrm"].type == "genrm" and listed["genrm"].supports_batch
    assert listed["remote"].type == "remote" and not listed["remote"].supports_batch
    assert "gsm8k" in listed["rules"].data_sources
    assert listed["limited"].supports_batch  # it forwards its inner manager's batching
