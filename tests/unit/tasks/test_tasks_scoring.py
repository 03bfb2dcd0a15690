"""Held-out scoring with the reward-service's rule: every warm-start answer is one the rule
rewards, a perturbed one is not, and `score` agrees with `score_arith` on tricky replies."""

from __future__ import annotations

import pytest

from relayrl.reward.items import RewardItem, Status
from relayrl.reward.managers.rules import RULE_SCORERS, score_arith
from relayrl.tasks import TASKS, score

TASK_NAMES = sorted(TASKS)


def final_answers(name: str) -> list[tuple[str, str]]:
    """(last SFT answer, ground truth) for 100 warm-start questions of the task."""
    task = TASKS[name]
    questions = task.questions("train", 100, seed=0, stream="sft")
    return [(task.sft_turns(q)[-1]["answer"], str(q.answer)) for q in questions]


@pytest.mark.parametrize("name", TASK_NAMES)
def test_every_warm_start_answer_is_rewarded_and_a_perturbed_one_is_not(name: str) -> None:
    task = TASKS[name]
    assert task.data_source in RULE_SCORERS
    for answer, truth in final_answers(name):
        assert score(task, answer, truth)
        assert not score(task, f"Answer: {int(truth) + 1}", truth)
        assert not score(task, answer.replace("Answer:", "answer:"), truth)
        assert not score(task, f"{answer}\nAnswer: {int(truth) - 1}", truth)  # the last counts


def test_lookup_intermediate_turns_are_not_rewarded_alone() -> None:
    task = TASKS["lookup"]
    question = task.questions("train", 1, seed=0, stream="sft")[0]
    calls, final = task.sft_examples(1, seed=0)
    assert not score(task, calls["answer"], str(question.answer))
    # The gateway sends the whole decoded response: calls, tool answers, final answer.
    transcript = "\n".join(
        [calls["answer"], *(m["content"] for m in final["messages"][3:]), final["answer"]]
    )
    assert score(task, transcript, str(question.answer))


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        ("Answer: 12", "12"),
        ("Answer: 12,000", "12"),
        ("Answer: 12.5", "12"),
        ("Answer:-3", "-3"),
        ("12 + 0 = 12", "12"),
        ("Answer: 1\nAnswer: 12.", "12"),
    ],
)
def test_score_is_the_reward_services_arith_rule(response: str, truth: str) -> None:
    item = RewardItem(item_id="x", data_source="arith", response=response, ground_truth=truth)
    for name in TASK_NAMES:
        assert score(TASKS[name], response, truth) is (score_arith(item).status is Status.OK)
