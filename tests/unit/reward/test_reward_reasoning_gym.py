"""The `reasoning_gym` manager: reasoning-gym's own checkers on items relayrl's task writes;
a missing answer is a wrong answer, a malformed item is refused, never scored 0."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.reward.items import InvalidItem, RewardItem, Status
from relayrl.reward.managers.base import ManagerContext
from relayrl.reward.managers.reasoning_gym import ReasoningGymConfig, score_item
from relayrl.tasks.reasoning_gym import ReasoningGymTask, ground_truth


def item(response: str, truth: str, source: str = "reasoning_gym:leg_counting") -> RewardItem:
    return RewardItem(item_id="i", data_source=source, response=response, ground_truth=truth)


def an_entry(dataset: str = "leg_counting") -> dict:
    import reasoning_gym

    return reasoning_gym.create_dataset(dataset, size=1, seed=3)[0]


def test_the_checker_decides() -> None:
    entry = an_entry()
    truth = ground_truth(entry)
    right = score_item(item(f"thinking <answer>{entry['answer']}</answer>", truth))
    assert (right.score, right.status) == (1.0, Status.OK)
    wrong = score_item(item("<answer>0</answer>", truth))
    assert (wrong.score, wrong.status) == (0.0, Status.POLICY_FAIL)
    untagged = score_item(item(entry["answer"], truth))
    assert untagged.status is Status.POLICY_FAIL and "no <answer>" in untagged.message


def test_partial_credit_is_the_checkers_score() -> None:
    entry = an_entry("word_sorting")
    verdict = score_item(item(f"<answer>{entry['answer'][:-1]}</answer>", ground_truth(entry),
                              "reasoning_gym:word_sorting"))  # fmt: skip
    assert 0.0 <= verdict.score < 1.0 and verdict.status is Status.POLICY_FAIL


@pytest.mark.parametrize(
    ("source", "truth", "message"),
    [
        ("gsm8k", '{"answer": "1"}', "is not reasoning_gym:<dataset>"),
        ("reasoning_gym:nope", '{"answer": "1"}', "no dataset 'nope'"),
        ("reasoning_gym:leg_counting", "292", "the ground truth must be the JSON"),
    ],
)
def test_malformed_items_are_refused_before_queueing(source: str, truth: str, message: str):
    manager = ReasoningGymConfig(type="reasoning_gym").build("rg", ManagerContext())
    with pytest.raises(InvalidItem, match=message):
        manager.validate(item("<answer>1</answer>", truth, source))


def test_the_manager_scores_what_the_task_writes() -> None:
    task = ReasoningGymTask.create("basic_arithmetic", {})
    record = task.prompts("train", 1, seed=0)[0]
    manager = ReasoningGymConfig(type="reasoning_gym").build("rg", ManagerContext())
    import json

    answer = json.loads(record["ground_truth"])["answer"]
    response = f"<answer>{answer}</answer>"
    verdict = asyncio.run(manager.score(item(response, record["ground_truth"],
                                             record["data_source"])))  # fmt: skip
    assert verdict.status is Status.OK
