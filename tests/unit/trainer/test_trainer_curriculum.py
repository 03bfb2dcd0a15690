"""The feeder's curriculum: every prompt once per epoch or set aside with a reason (the coverage
floor), replays of prompts that still have signal, re-issues of prompts whose group could not
be trained for a reason outside the policy, and a state that a resumed trainer restores to issue
exactly what the interrupted one would have. Pure logic: no queue, no model."""

from __future__ import annotations

import json
import random

import pytest

from relayrl.trainer.curriculum import Curriculum, CurriculumConfig, Issue, RetryConfig

SIGNAL = [1.0, 0.0, 1.0, 0.0]
ALL_WRONG = [0.0, 0.0, 0.0, 0.0]
ALL_RIGHT = [1.0, 1.0, 1.0, 1.0]


def curriculum(n: int = 10, seed: int = 3, budget: int = 3, **settings) -> Curriculum:
    return Curriculum(n, seed, CurriculumConfig(**settings), RetryConfig(budget=budget))


class Feed:
    """Names groups as the feeder does (g0, g1, ...) and issues them from `c`."""

    def __init__(self, c: Curriculum, num_issued: int = 0) -> None:
        self.c = c
        self.num_issued = num_issued

    def issue(self, step: int) -> tuple[str, Issue]:
        name = f"g{self.num_issued}"
        self.num_issued += 1
        return name, self.c.next_issue(step, name)

    def prompts(self, step: int, count: int) -> list[tuple[str, int]]:
        return [(name, issue.index) for name, issue in (self.issue(step) for _ in range(count))]


def test_without_observations_an_epoch_is_every_prompt_once_in_a_seeded_order() -> None:
    c = curriculum(10)
    feed = Feed(c)
    first = [index for _, index in feed.prompts(0, 10)]
    assert sorted(first) == list(range(10))
    second = [index for _, index in feed.prompts(0, 10)]
    assert sorted(second) == list(range(10)) and second != first  # a new permutation
    again = Feed(curriculum(10))
    assert [index for _, index in again.prompts(0, 10)] == first
    assert c.epoch == 1


def test_prompts_with_signal_are_replayed_up_to_the_share() -> None:
    c = curriculum(100, replay_share=0.5)
    feed = Feed(c)
    issued = feed.prompts(0, 4)
    first = issued[0][1]
    for name, index in issued:
        c.observe(name, 0, SIGNAL if index == first else ALL_WRONG)
    nxt = feed.prompts(1, 6)
    assert [i for _, i in nxt].count(first) == 1  # replayed once: in flight until observed
    assert len({i for _, i in nxt}) == 6
    (replay,) = [name for name, i in nxt if i == first]
    c.observe(replay, 1, SIGNAL)
    later = [i for _, i in feed.prompts(2, 4)]
    assert later.count(first) == 1


def test_a_prompt_without_signal_twice_is_set_aside_with_its_reason() -> None:
    c = curriculum(4, replay_share=0.0, set_aside_after=2, max_set_aside_epochs=4)
    feed = Feed(c)
    epoch0 = feed.prompts(0, 4)
    (hard_name, hard), (easy_name, easy) = epoch0[0], epoch0[1]
    c.observe(hard_name, 0, ALL_WRONG)
    c.observe(easy_name, 0, ALL_RIGHT)
    epoch1 = dict((i, name) for name, i in feed.prompts(1, 4))
    assert sorted(epoch1) == [0, 1, 2, 3]  # one group without signal is not enough
    c.observe(epoch1[hard], 1, ALL_WRONG)
    c.observe(epoch1[easy], 2, ALL_RIGHT)
    epoch2 = [i for _, i in feed.prompts(3, 2)]
    assert hard not in epoch2 and easy not in epoch2
    aside = {a.index: a for a in c.take_set_aside()}
    assert set(aside) == {hard, easy}
    assert aside[hard].reason == "no signal in its last 2 groups (0/4 at step 0, 0/4 at step 1)"
    assert aside[easy].reason == "no signal in its last 2 groups (4/4 at step 0, 4/4 at step 2)"
    assert (aside[hard].epoch, aside[hard].epochs) == (2, 1)
    # epoch 3: probed again; one more group without signal sets it aside for two epochs
    epoch3 = dict((i, name) for name, i in feed.prompts(4, 4))
    assert hard in epoch3
    c.observe(epoch3[hard], 4, ALL_WRONG)
    feed.prompts(5, 4 * 3)
    (again,) = [a for a in c.take_set_aside() if a.index == hard]
    assert (again.epoch, again.epochs) == (4, 2)


def test_coverage_floor_every_prompt_is_issued_or_set_aside_each_epoch() -> None:
    rng = random.Random(0)
    c = curriculum(50, replay_share=0.5)
    feed = Feed(c)
    issued_by_epoch: dict[int, set[int]] = {}
    for step in range(60):
        for _ in range(8):
            name, issue = feed.issue(step)
            issued_by_epoch.setdefault(c.epoch, set()).add(issue.index)
            c.observe(name, step, rng.choice([SIGNAL, ALL_WRONG, ALL_RIGHT, [0.0]]))
    aside_by_epoch: dict[int, set[int]] = {}
    for a in c.take_set_aside():  # a record covers `epochs` epochs from its own
        for epoch in range(a.epoch, a.epoch + a.epochs):
            aside_by_epoch.setdefault(epoch, set()).add(a.index)
    finished = range(c.epoch)  # the current epoch is not finished
    assert len(finished) >= 3
    for epoch in finished:
        covered = issued_by_epoch.get(epoch, set()) | aside_by_epoch.get(epoch, set())
        assert covered == set(range(50)), epoch


def test_infrastructure_failures_never_set_a_prompt_aside() -> None:
    c = curriculum(3, replay_share=0.0, set_aside_after=1, budget=0)
    feed = Feed(c)
    for step in range(6):  # two epochs in which every group of every prompt failed
        for name, _ in feed.prompts(step, 3):
            c.retry(name, "no_valid", "every rollout failed")
    assert c.take_set_aside() == []


def run(feed: Feed, steps: range, seed: int, failures: float = 0.0) -> list[int]:
    """Issues 4 groups per step and judges them with outcomes drawn from `seed`: a share
    `failures` of them cannot be trained (no valid member), the rest are observed."""
    rng = random.Random(seed)
    out = []
    for step in steps:
        batch = feed.prompts(step, 4)
        out += [index for _, index in batch]
        for name, _ in batch:
            if rng.random() < failures:
                feed.c.retry(name, "no_valid", "every rollout failed")
            else:
                feed.c.observe(name, step, rng.choice([SIGNAL, ALL_WRONG, ALL_RIGHT]))
    return out


def saved(c: Curriculum) -> dict:
    return json.loads(json.dumps(c.state_dict()))  # as the checkpoint holds it


def test_a_restored_state_issues_what_the_interrupted_run_would_have() -> None:
    original = Feed(curriculum(30, replay_share=0.5))
    run(original, range(10), seed=1, failures=0.2)
    state, cursor = saved(original.c), original.num_issued
    expected = run(original, range(10, 25), seed=2, failures=0.2)
    restored = Feed(curriculum(30, replay_share=0.5), cursor)
    restored.c.load_state_dict(state)
    assert run(restored, range(10, 25), seed=2, failures=0.2) == expected


def test_groups_issued_after_the_checkpoint_are_adopted_not_reissued() -> None:
    original = Feed(curriculum(12, replay_share=0.0))
    run(original, range(2), seed=1)  # 8 of 12 prompts of epoch 0
    state, cursor = saved(original.c), original.num_issued
    after = [original.issue(2) for _ in range(3)]  # issued, then the trainer crashed
    restored = Feed(curriculum(12, replay_share=0.0), cursor)
    restored.c.load_state_dict(state)
    for name, issue in after:  # read back from the queue
        restored.c.adopt(name, issue)
    restored.num_issued += len(after)
    rest = [i for _, i in restored.prompts(3, 1)]
    epoch0 = {issue.index for _, issue in after} | set(rest)
    assert len(epoch0) == 4 and restored.c.epoch == 0  # the 4 prompts left, none twice
    restored.prompts(3, 1)
    assert restored.c.epoch == 1


def test_a_disabled_curriculum_is_a_seeded_permutation_per_epoch() -> None:
    c = curriculum(6, enabled=False)
    feed = Feed(c)
    for name, _ in feed.prompts(0, 6):
        c.observe(name, 0, ALL_WRONG)
    assert sorted(i for _, i in feed.prompts(1, 6)) == list(range(6))
    assert c.take_set_aside() == []


# -- re-issues ----------------------------------------------------------------------------------


def test_a_group_that_failed_as_infrastructure_is_reissued_first_with_its_prompt() -> None:
    c = curriculum(20, replay_share=0.5)
    feed = Feed(c)
    batch = feed.prompts(0, 4)
    for name, _ in batch[1:]:
        c.observe(name, 0, SIGNAL)  # replays are due, the walk goes on
    failed, prompt = batch[0]
    assert c.retry(failed, "no_valid", "4 of 4 rollouts failed") is None
    name, issue = feed.issue(1)
    assert issue == Issue(prompt, retry_of=failed, retry=1)  # before any replay or walk
    assert feed.issue(1)[1].retry_of == ""
    assert c.take_retries() == ({"no_valid": 1}, [])
    assert c.take_retries() == ({}, [])


def test_one_issue_is_reissued_at_most_budget_times_then_skipped_with_its_cause() -> None:
    c = curriculum(5, replay_share=0.0, budget=2)
    feed = Feed(c)
    name, issue = feed.issue(0)
    chain = [name]
    for _ in range(2):
        assert c.retry(name, "one_valid", "1 of 4 valid") is None
        name, retry = feed.issue(1)
        assert (retry.index, retry.retry_of) == (issue.index, chain[-1])
        chain.append(name)
    skipped = c.retry(name, "stale", "staleness 3 > 2 at step 4")
    assert skipped is not None
    assert (skipped.index, skipped.group, skipped.retries) == (issue.index, chain[-1], 2)
    assert (skipped.cause, skipped.reason) == ("stale", "staleness 3 > 2 at step 4")
    assert feed.issue(2)[1].retry_of == ""  # nothing due any more: the walk goes on
    assert c.take_retries() == ({"one_valid": 2}, [skipped])
    # the next issue of that prompt (the next epoch) has a budget of its own
    later = dict((i, n) for n, i in feed.prompts(3, 8))
    assert c.retry(later[issue.index], "no_valid", "every rollout failed") is None


def test_a_budget_of_zero_skips_at_once() -> None:
    c = curriculum(3, budget=0)
    name, _ = Feed(c).issue(0)
    skipped = c.retry(name, "no_valid", "every rollout failed")
    assert skipped is not None and skipped.retries == 0
    assert c.take_retries() == ({}, [skipped])


def test_a_verdict_heard_again_changes_nothing() -> None:
    """A trainer stopped in the middle of a step checkpoints what it judged; the step re-runs
    and judges the same groups again."""
    c = curriculum(10, replay_share=0.0)
    feed = Feed(c)
    (failed, _), (kept, _) = feed.prompts(0, 2)
    c.retry(failed, "no_valid", "every rollout failed")
    c.observe(kept, 0, SIGNAL)
    restored = curriculum(10, replay_share=0.0)
    restored.load_state_dict(saved(c))
    for twin in (c, restored):
        assert not twin.in_flight(failed) and not twin.in_flight(kept)
        assert twin.retry(failed, "no_valid", "every rollout failed") is None
        twin.observe(kept, 0, SIGNAL)
        assert twin.take_retries() == ({"no_valid": 1}, [])  # one re-issue, not two
        assert [twin.next_issue(1, "g2").retry_of, twin.next_issue(1, "g3").retry_of] == [
            failed,
            "",
        ]


@pytest.mark.parametrize("replay_share", [0.0, 0.5])
def test_a_resumed_trainer_reissues_exactly_the_prompts_not_yet_trained(
    replay_share: float,
) -> None:
    """Run, checkpoint with groups in flight, go on (some of them fail and are re-issued),
    crash; restore, adopt what the queue holds past the checkpoint, hear the verdicts again:
    what is due is what the interrupted run had due, and it goes on as that run would."""
    budget = 2
    original = Feed(curriculum(16, replay_share=replay_share, budget=budget))
    run(original, range(3), seed=5, failures=0.3)
    in_flight = original.prompts(3, 4)  # in flight at the checkpoint
    state, cursor = saved(original.c), original.num_issued
    # after the checkpoint: every group in flight fails, and is re-issued; then a crash
    adopted: list[tuple[str, Issue]] = []
    for name, _ in in_flight:
        original.c.retry(name, "no_valid", "every rollout failed")
        adopted.append(original.issue(4))
    adopted += [original.issue(4) for _ in range(2)]
    retried, skipped = original.c.take_retries()
    open_groups = original.c.in_flight_groups()
    expected = run(original, range(5, 12), seed=6, failures=0.3)

    restored = Feed(curriculum(16, replay_share=replay_share, budget=budget), cursor)
    restored.c.load_state_dict(state)
    for name, issue in adopted:
        restored.c.adopt(name, issue)
    restored.num_issued += len(adopted)
    assert all(restored.c.reissued(name) for name, _ in in_flight)
    for name, _ in in_flight:  # the re-run step judges them again
        assert restored.c.retry(name, "no_valid", "every rollout failed") is None
    assert restored.c.take_retries() == (retried, skipped)
    assert restored.c.in_flight_groups() == open_groups
    assert run(restored, range(5, 12), seed=6, failures=0.3) == expected


def test_a_group_reissued_before_a_restart_is_never_trained_after_it() -> None:
    """Consumed as too stale after the checkpoint and re-issued, it is judged again at an
    earlier step after the restore, where it may be fresh: the feeder asks `reissued`."""
    original = Feed(curriculum(8, replay_share=0.0))
    (stale, _), _ = original.prompts(0, 2)
    state, cursor = saved(original.c), original.num_issued
    original.c.retry(stale, "stale", "staleness 3 > 2 at step 2")
    name, issue = original.issue(2)
    restored = Feed(curriculum(8, replay_share=0.0), cursor)
    restored.c.load_state_dict(state)
    restored.c.adopt(name, issue)
    assert restored.c.reissued(stale) and restored.c.in_flight(stale)
    assert restored.c.retry(stale, "stale", "re-issued before the restart") is None
    assert not restored.c.reissued(stale) and not restored.c.in_flight(stale)
    assert restored.c.next_issue(1, "g3").retry_of == ""  # no second re-issue


def test_reissues_and_skips_not_yet_recorded_survive_a_checkpoint() -> None:
    c = curriculum(6, budget=0)
    feed = Feed(c)
    (a, _), _ = feed.prompts(0, 2)
    c.retry(a, "no_valid", "every rollout failed")
    restored = curriculum(6, budget=0)
    restored.load_state_dict(saved(c))
    assert restored.take_retries() == c.take_retries()


def test_an_older_checkpoints_state_is_refused_with_what_to_do() -> None:
    c = curriculum(4)
    state = saved(c)
    del state["format"]
    with pytest.raises(ValueError, match="older relayrl"):
        c.load_state_dict(state)
