"""Which prompt the feeder issues next: every prompt once per epoch, plus replays of prompts
that still have signal (docs/algorithms.md#curriculum).

A group without signal (every valid answer scored the same) costs a full rollout and trains
nothing. Which prompts have signal is only known by trying them, and it changes as the policy
learns, so the curriculum remembers each prompt's recent groups and issues from two sources:

- the epoch walk: a seeded permutation of every prompt, one per epoch, walked in order. A
  prompt whose last `set_aside_after` groups all had no signal is set aside for this epoch (for
  1, 2, 4, ... up to `max_set_aside_epochs` epochs the longer it stays without signal), and the
  set-aside is recorded with its reason. So every prompt is issued at least once per epoch or is
  recorded as set aside: the coverage floor. A prompt whose groups failed as infrastructure
  learns nothing about its difficulty and is never set aside for it.
- the replay pool: prompts whose last group had signal, oldest first. Up to `replay_share` of
  the groups issued are replays, while the pool has a prompt that is not in flight.

Determinism. The curriculum is a pure function of its seed and the calls it gets (issue,
observe, adopt); its state is JSON and goes into the trainer's checkpoint. A resumed trainer
restores it and `adopt`s the groups issued after the checkpoint, read back from the
TransferQueue, where a group's uid names one prompt forever. Given the same observations
after that, it issues the same prompts as the run that was interrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from relayrl.core.config import StrictModel

HISTORY = 4
"""Groups remembered per prompt."""


class CurriculumSettings(StrictModel):
    """How the feeder chooses prompts (docs/algorithms.md#curriculum)."""

    enabled: bool = Field(
        True,
        description="false: every prompt once per epoch in a seeded order, nothing replayed or "
        "set aside.",
    )
    replay_share: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="At most this share of issued groups re-issue a prompt whose last group "
        "had signal; the rest walk the epoch.",
    )
    set_aside_after: int = Field(
        2,
        ge=1,
        le=HISTORY,
        description="A prompt whose last this many groups had no signal is set aside when the "
        "epoch walk reaches it.",
    )
    max_set_aside_epochs: int = Field(
        4, ge=1, le=64, description="The longest a prompt is set aside, in epochs."
    )


@dataclass(frozen=True)
class Outcome:
    """One group of a prompt, as the trainer judged it."""

    step: int
    num_valid: int
    num_passed: int  # valid answers with a positive reward
    signal: bool

    def text(self) -> str:
        return f"{self.num_passed}/{self.num_valid} at step {self.step}"


@dataclass(frozen=True)
class SetAside:
    """A prompt the epoch walk skipped, and why."""

    epoch: int
    index: int
    epochs: int
    reason: str


@dataclass
class _Prompt:
    history: list[Outcome] = field(default_factory=list)
    num_outcomes: int = 0  # observed groups, ever
    aside_until_epoch: int = -1  # set aside through this epoch
    aside_at_outcome: int = -1  # num_outcomes when last set aside: probed before the next
    covered_epoch: int = -1  # last epoch in which it was issued


class Curriculum:
    """The feeder's choice of prompt, over prompts `0 .. num_prompts - 1`."""

    def __init__(self, num_prompts: int, seed: int, settings: CurriculumSettings) -> None:
        if num_prompts < 1:
            raise ValueError("a curriculum needs at least one prompt")
        self._num_prompts = num_prompts
        self._seed = seed
        self._settings = settings
        self._prompts = [_Prompt() for _ in range(num_prompts)]
        self._epoch = 0
        self._position = 0  # in the epoch's permutation
        self._permutation: list[int] = self._permute(0)
        self._pool: list[int] = []  # prompts whose last group had signal, oldest first
        self._inflight: dict[int, int] = {}  # prompt -> groups issued and not yet observed
        self._num_issued = 0
        self._num_replays = 0
        self.set_aside: list[SetAside] = []
        """Set-asides since the last `take_set_aside()`."""

    # -- issuing ----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_prompt(self, step: int) -> int:
        """The prompt of the next group (and records it as issued)."""
        index = self._replay() if self._replay_due() else None
        if index is None:
            index = self._walk(step)
        self._issued(index)
        return index

    def _replay_due(self) -> bool:
        s = self._settings
        if not s.enabled or not s.replay_share:
            return False
        return self._num_replays < s.replay_share * (self._num_issued + 1)

    def _replay(self) -> int | None:
        for i, index in enumerate(self._pool):
            if index not in self._inflight:
                del self._pool[i]
                self._num_replays += 1
                return index
        return None

    def _walk(self, step: int) -> int:
        """The next prompt of the epoch walk that is neither covered nor set aside."""
        for _ in range(2 * self._num_prompts + 1):
            if self._position == self._num_prompts:
                self._epoch += 1
                self._position = 0
                self._permutation = self._permute(self._epoch)
            index = self._permutation[self._position]
            self._position += 1
            prompt = self._prompts[index]
            if prompt.covered_epoch == self._epoch:
                continue  # issued this epoch already (as a replay adopted on resume)
            if self._set_aside(index, prompt):
                continue
            prompt.covered_epoch = self._epoch
            return index
        # every prompt is set aside: probe the one set aside longest ago rather than stall
        index = self._permutation[0]
        self._prompts[index].covered_epoch = self._epoch
        return index

    def _set_aside(self, index: int, prompt: _Prompt) -> bool:
        if not self._settings.enabled:
            return False
        if prompt.aside_until_epoch >= self._epoch:
            return True
        if prompt.aside_at_outcome == prompt.num_outcomes:
            return False  # back from a set-aside: probed once before another
        s = self._settings
        recent = prompt.history[-s.set_aside_after :]
        if len(recent) < s.set_aside_after or any(o.signal for o in recent):
            return False
        quiet = 0  # groups in a row without signal
        for outcome in reversed(prompt.history):
            if outcome.signal:
                break
            quiet += 1
        epochs = min(2 ** (quiet - s.set_aside_after), s.max_set_aside_epochs)
        prompt.aside_until_epoch = self._epoch + epochs - 1
        prompt.aside_at_outcome = prompt.num_outcomes
        reason = "no signal in its last {} groups ({})".format(
            quiet, ", ".join(o.text() for o in prompt.history[-quiet:])
        )
        self.set_aside.append(SetAside(self._epoch, index, epochs, reason))
        return True

    def _issued(self, index: int) -> None:
        self._inflight[index] = self._inflight.get(index, 0) + 1
        self._num_issued += 1

    def _permute(self, epoch: int) -> list[int]:
        import numpy as np  # not on the config's import path

        rng = np.random.default_rng([self._seed, epoch])
        return [int(i) for i in rng.permutation(self._num_prompts)]

    # -- learning about prompts -------------------------------------------------------------

    def observe(self, index: int, step: int, valid_rewards: Sequence[float]) -> None:
        """A group of prompt `index` was judged at `step`; `valid_rewards` are the rewards of its
        members that did not fail as infrastructure."""
        self._landed(index)
        if len(valid_rewards) < 2:
            return  # failures say nothing about the prompt's difficulty
        outcome = Outcome(
            step=step,
            num_valid=len(valid_rewards),
            num_passed=sum(1 for r in valid_rewards if r > 0),
            signal=max(valid_rewards) != min(valid_rewards),
        )
        prompt = self._prompts[index]
        prompt.history = [*prompt.history, outcome][-HISTORY:]
        prompt.num_outcomes += 1
        if index in self._pool:
            self._pool.remove(index)
        if outcome.signal:
            self._pool.append(index)

    def forget(self, index: int) -> None:
        """A group of prompt `index` that will never be observed (evicted as stale)."""
        self._landed(index)

    def _landed(self, index: int) -> None:
        count = self._inflight.get(index, 0)
        if count <= 1:
            self._inflight.pop(index, None)
        else:
            self._inflight[index] = count - 1

    def adopt(self, index: int) -> None:
        """A group of prompt `index` issued after the checkpoint this state comes from (read
        back from the TransferQueue): the prompt counts as issued, as it was."""
        if index in self._pool and index not in self._inflight:
            self._pool.remove(index)
            self._num_replays += 1
        elif self._prompts[index].covered_epoch != self._epoch:
            self._prompts[index].covered_epoch = self._epoch
        else:
            self._num_replays += 1
        self._issued(index)

    def take_set_aside(self) -> list[SetAside]:
        taken, self.set_aside = self.set_aside, []
        return taken

    # -- checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON: what a resumed trainer needs to issue as this one would."""
        return {
            "num_prompts": self._num_prompts,
            "epoch": self._epoch,
            "position": self._position,
            "pool": list(self._pool),
            "inflight": {str(k): v for k, v in self._inflight.items()},
            "num_issued": self._num_issued,
            "num_replays": self._num_replays,
            "prompts": {
                str(i): {
                    "history": [[o.step, o.num_valid, o.num_passed, o.signal] for o in p.history],
                    "num_outcomes": p.num_outcomes,
                    "aside_until_epoch": p.aside_until_epoch,
                    "aside_at_outcome": p.aside_at_outcome,
                    "covered_epoch": p.covered_epoch,
                }
                for i, p in enumerate(self._prompts)
                if p.num_outcomes or p.covered_epoch >= 0
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != self._num_prompts:
            raise ValueError(
                f"the checkpoint's curriculum has {state['num_prompts']} prompts, the prompts "
                f"file {self._num_prompts}: resume with the prompts the run started with"
            )
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._permutation = self._permute(self._epoch)
        self._pool = [int(i) for i in state["pool"]]
        self._inflight = {int(k): int(v) for k, v in state["inflight"].items()}
        self._num_issued = int(state["num_issued"])
        self._num_replays = int(state["num_replays"])
        self._prompts = [_Prompt() for _ in range(self._num_prompts)]
        for key, saved in state["prompts"].items():
            self._prompts[int(key)] = _Prompt(
                history=[
                    Outcome(int(a), int(b), int(c), bool(d)) for a, b, c, d in saved["history"]
                ],
                num_outcomes=int(saved["num_outcomes"]),
                aside_until_epoch=int(saved["aside_until_epoch"]),
                aside_at_outcome=int(saved["aside_at_outcome"]),
                covered_epoch=int(saved["covered_epoch"]),
            )
