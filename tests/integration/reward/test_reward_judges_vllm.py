"""The generative judge managers against the real vLLM server on the tiny model (the random
policy is steered into the verdict format with vLLM's structured outputs, which the managers'
`extra_body` passes through): one completions request per batch for genrm, one chat request
per item for remote, verdicts parsed into statuses."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from relayrl.engine.process import EngineProcess
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2
from relayrl_testkit.helpers.reward import RewardProcess

VERDICT = {"structured_outputs": {"regex": "Verdict: (Correct|Incorrect)"}}


def test_genrm_and_remote_judge_with_a_real_vllm_server(
    engine: EngineProcess, tmp_path: Path
) -> None:
    judge: dict[str, Any] = {
        "base_url": engine.url,
        "model": "policy",
        "max_tokens": 64,  # under the grammar a verdict may take a token per character
        "extra_body": VERDICT,
        "timeout_s": 120,
    }
    config = {
        "managers": {
            "genrm": {"type": "genrm", **judge},
            "remote": {"type": "remote", **judge},
        },
        "default_manager": "genrm",
        "pipeline": {"num_workers": 1},
    }
    service = RewardProcess(tmp_path / "svc", config).start()
    items = [
        common_pb2.RewardItem(
            item_id=f"q{k}", prompt="What is 6*7?", response=answer, ground_truth="42"
        )
        for k, answer in enumerate(["42", "41", "7"])
    ]

    async def score(manager: str) -> list[common_pb2.RewardResult]:
        channel, stub = service.stub()
        async with channel:
            request = reward_pb2.ScoreRequest(
                items=items, options=reward_pb2.ScoreOptions(manager=manager)
            )
            return list((await stub.Score(request, timeout=120)).results)

    try:
        for manager in ("genrm", "remote"):
            results = asyncio.run(score(manager))
            assert [r.item_id for r in results] == ["q0", "q1", "q2"]
            for result in results:
                # A random judge may say either; what matters is that its real answer was
                # parsed into a judged status with the matching reward.
                assert result.status in (
                    common_pb2.REWARD_STATUS_OK,
                    common_pb2.REWARD_STATUS_POLICY_FAIL,
                ), (manager, result)
                expected = 1.0 if result.status == common_pb2.REWARD_STATUS_OK else 0.0
                assert result.score == expected and result.manager == manager
    finally:
        service.kill()
