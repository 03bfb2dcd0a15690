"""The feeder's curriculum: every prompt once per epoch or set aside with a reason (the coverage
floor), replays of prompts that still have signal, and a state that a resumed trainer restores
to issue exactly what the interrupted one would have. Pure logic: no queue, no model."""

from __future__ import annotations

import json
import random

from relayrl.trainer.curriculum import Curriculum, CurriculumSettings

SIGNAL = [1.0, 0.0, 1.0, 0.0]
ALL_WRONG = [0.0, 0.0, 0.0, 0.0]
ALL_RIGHT = [1.0, 1.0, 1.0, 1.0]


def curriculum(n: int = 10, seed: int = 3, **settings) -> Curriculum:
    return Curriculum(n, seed, CurriculumSettings(**settings))


def test_without_observations_an_epoch_is_every_prompt_once_in_a_seeded_order() -> None:
    c = curriculum(10)
    first = [c.next_prompt(0) for _ in range(10)]
    assert sorted(first) == list(range(10))
    second = [c.next_prompt(0) for _ in range(10)]
    assert sorted(second) == list(range(10)) and second != first  # a new permutation
    again = curriculum(10)
    assert [again.next_prompt(0) for _ in range(10)] == first
    assert c.epoch == 1


def test_prompts_with_signal_are_replayed_up_to_the_share() -> None:
    c = curriculum(100, replay_share=0.5)
    issued = [c.next_prompt(0) for _ in range(4)]
    for index in issued:
        c.observe(index, 0, SIGNAL if index == issued[0] else ALL_WRONG)
    nxt = [c.next_prompt(1) for _ in range(6)]
    assert nxt.count(issued[0]) == 1  # replayed once: it is in flight until observed again
    assert len(set(nxt)) == 6
    c.observe(issued[0], 1, SIGNAL)
    later = [c.next_prompt(2) for _ in range(4)]
    assert later.count(issued[0]) == 1
    replays = nxt.count(issued[0]) + later.count(issued[0])
    assert replays <= 0.5 * 14


def test_a_prompt_without_signal_twice_is_set_aside_with_its_reason() -> None:
    c = curriculum(4, replay_share=0.0, set_aside_after=2, max_set_aside_epochs=4)
    epoch0 = [c.next_prompt(0) for _ in range(4)]
    hard, easy = epoch0[0], epoch0[1]
    c.observe(hard, 0, ALL_WRONG)
    c.observe(easy, 0, ALL_RIGHT)
    epoch1 = [c.next_prompt(1) for _ in range(4)]
    assert sorted(epoch1) == [0, 1, 2, 3]  # one group without signal is not enough
    c.observe(hard, 1, ALL_WRONG)
    c.observe(easy, 2, ALL_RIGHT)
    epoch2 = [c.next_prompt(3) for _ in range(2)]
    assert hard not in epoch2 and easy not in epoch2
    aside = {a.index: a for a in c.take_set_aside()}
    assert set(aside) == {hard, easy}
    assert aside[hard].reason == "no signal in its last 2 groups (0/4 at step 0, 0/4 at step 1)"
    assert aside[easy].reason == "no signal in its last 2 groups (4/4 at step 0, 4/4 at step 2)"
    assert (aside[hard].epoch, aside[hard].epochs) == (2, 1)
    # epoch 3: probed again; one more group without signal sets it aside for two epochs
    epoch3 = [c.next_prompt(4) for _ in range(4)]
    assert hard in epoch3
    c.observe(hard, 4, ALL_WRONG)
    for _ in range(4 * 3):
        c.next_prompt(5)
    (again,) = [a for a in c.take_set_aside() if a.index == hard]
    assert (again.epoch, again.epochs) == (4, 2)


def test_coverage_floor_every_prompt_is_issued_or_set_aside_each_epoch() -> None:
    rng = random.Random(0)
    c = curriculum(50, replay_share=0.5)
    issued_by_epoch: dict[int, set[int]] = {}
    for step in range(60):
        for _ in range(8):
            index = c.next_prompt(step)
            issued_by_epoch.setdefault(c.epoch, set()).add(index)
            c.observe(index, step, rng.choice([SIGNAL, ALL_WRONG, ALL_RIGHT, [0.0]]))
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
    c = curriculum(3, replay_share=0.0, set_aside_after=1)
    for step in range(6):  # two epochs in which every group of every prompt failed
        for _ in range(3):
            c.observe(c.next_prompt(step), step, [])
    assert c.take_set_aside() == []


def run(c: Curriculum, steps: range, seed: int) -> list[int]:
    """Issues 4 prompts per step and observes them with outcomes drawn from `seed`."""
    rng = random.Random(seed)
    out = []
    for step in steps:
        batch = [c.next_prompt(step) for _ in range(4)]
        out += batch
        for index in batch:
            c.observe(index, step, rng.choice([SIGNAL, ALL_WRONG, ALL_RIGHT]))
    return out


def test_a_restored_state_issues_what_the_interrupted_run_would_have() -> None:
    original = curriculum(30, replay_share=0.5)
    run(original, range(10), seed=1)
    saved = json.loads(json.dumps(original.state_dict()))  # as the checkpoint holds it
    expected = run(original, range(10, 25), seed=2)
    restored = curriculum(30, replay_share=0.5)
    restored.load_state_dict(saved)
    assert run(restored, range(10, 25), seed=2) == expected


def test_groups_issued_after_the_checkpoint_are_adopted_not_reissued() -> None:
    original = curriculum(12, replay_share=0.0)
    run(original, range(2), seed=1)  # 8 of 12 prompts of epoch 0
    saved = json.loads(json.dumps(original.state_dict()))
    after = [original.next_prompt(2) for _ in range(3)]  # issued, then the trainer crashed
    restored = curriculum(12, replay_share=0.0)
    restored.load_state_dict(saved)
    for index in after:  # read back from the queue
        restored.adopt(index)
    rest = [restored.next_prompt(3) for _ in range(1)]
    epoch0 = set(after) | set(rest)
    assert len(epoch0) == 4 and restored.epoch == 0  # the 4 prompts left, none twice
    assert restored.next_prompt(3) is not None and restored.epoch == 1


def test_a_disabled_curriculum_is_a_seeded_permutation_per_epoch() -> None:
    c = curriculum(6, enabled=False)
    issued = [c.next_prompt(0) for _ in range(6)]
    for index in issued:
        c.observe(index, 0, ALL_WRONG)
    assert sorted(c.next_prompt(1) for _ in range(6)) == list(range(6))
    assert c.take_set_aside() == []
