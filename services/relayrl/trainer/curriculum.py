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

Above both comes a third source, retries: a group that cannot be trained for a reason outside
the policy (no valid member, one valid member, too stale under the `drop` policy) says nothing
about its prompt, so the prompt is re-issued at once, as a new group that names the one it
re-issues, up to `retry.budget` times per issue of a prompt. A prompt whose budget runs out is
recorded as skipped, with its cause (docs/algorithms.md#retries).

Determinism. The curriculum is a pure function of its seed and the calls it gets (issue,
observe, retry, adopt); its state is JSON and goes into the trainer's checkpoint. It knows the
groups in flight by name (the feeder's uids), so a verdict on a group it has already heard of
(a step re-run after a restart) changes nothing. A resumed trainer restores it and `adopt`s
the groups issued after the checkpoint, read back from the TransferQueue, where a group's uid
names one prompt forever. Given the same observations after that, it issues the same prompts
as the run that was interrupted, and re-issues no prompt twice for one failed group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from relayrl.core.config import StrictModel

HISTORY = 4
"""Groups remembered per prompt."""

STATE_FORMAT = 2
"""Version of `Curriculum.state_dict`: 2 names the groups in flight and holds the retries."""

RetryCause = Literal["no_valid", "one_valid", "stale"]
RETRY_CAUSES: tuple[RetryCause, ...] = ("no_valid", "one_valid", "stale")
"""Why a group could not be trained for a reason outside the policy: every member failed as
infrastructure; one member of several is valid (the others failed, so nothing to compare);
too stale to train (the `drop` policy evicted it or consumed it as stale)."""


class CurriculumConfig(StrictModel):
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


class RetryConfig(StrictModel):
    """What becomes of a group that cannot be trained for a reason outside the policy
    (docs/algorithms.md#retries)."""

    budget: int = Field(
        3,
        ge=0,
        le=100,
        description="A group without a valid member, with one valid member of several, or "
        "evicted as too stale is re-issued with the same prompt, ahead of every other prompt, "
        "up to this many times per issue of the prompt; 0: never.",
    )
    on_exhausted: Literal["skip", "stop"] = Field(
        "skip",
        description="When an issue's budget is spent: skip (the prompt is recorded as skipped "
        "with its cause, in the step record and the report, and the run goes on) or stop "
        "(the run ends with one line naming the prompt and the cause).",
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


@dataclass(frozen=True)
class Issue:
    """The prompt of an issued group, and which group it re-issues, if any."""

    index: int
    retry_of: str = ""  # the name of the group whose prompt this one re-issues
    retry: int = 0  # 0: a prompt's first group of an issue; k: its k-th re-issue


@dataclass(frozen=True)
class Skipped:
    """An issue of a prompt that ended untrained: its retry budget ran out."""

    index: int
    group: str  # its last group
    retries: int  # re-issues spent
    cause: RetryCause
    reason: str


@dataclass
class _Prompt:
    history: list[Outcome] = field(default_factory=list)
    num_outcomes: int = 0  # observed groups, ever
    aside_until_epoch: int = -1  # set aside through this epoch
    aside_at_outcome: int = -1  # num_outcomes when last set aside: probed before the next
    covered_epoch: int = -1  # last epoch in which it was issued


class Curriculum:
    """The feeder's choice of prompt, over prompts `0 .. num_prompts - 1`. Groups are named by
    the caller (the feeder's uids); the curriculum only compares the names."""

    def __init__(
        self,
        num_prompts: int,
        seed: int,
        settings: CurriculumConfig,
        retry: RetryConfig | None = None,
    ) -> None:
        if num_prompts < 1:
            raise ValueError("a curriculum needs at least one prompt")
        self._num_prompts = num_prompts
        self._seed = seed
        self._settings = settings
        self._retry = retry or RetryConfig()
        self._prompts = [_Prompt() for _ in range(num_prompts)]
        self._epoch = 0
        self._position = 0  # in the epoch's permutation
        self._permutation: list[int] = self._permute(0)
        self._pool: list[int] = []  # prompts whose last group had signal, oldest first
        self._inflight: dict[str, Issue] = {}  # groups issued and not yet judged
        self._retries: list[Issue] = []  # re-issues due, oldest first
        # groups whose re-issue was adopted on resume before their own verdict was heard again
        self._reissued: set[str] = set()
        self._num_issued = 0  # first groups of an issue (re-issues are not choices)
        self._num_replays = 0
        self.set_aside: list[SetAside] = []
        """Set-asides since the last `take_set_aside()`."""
        self.retried: Counter[str] = Counter()
        """Groups whose prompt was re-issued since the last `take_retries()`, by cause."""
        self.skipped: list[Skipped] = []
        """Issues given up since the last `take_retries()`."""

    # -- issuing ----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def retry_settings(self) -> RetryConfig:
        return self._retry

    def next_issue(self, step: int, group: str) -> Issue:
        """The prompt of the next group, named `group` (recorded as issued): a re-issue that is
        due, else a replay or the epoch walk's next prompt."""
        if self._retries:
            issue = self._retries.pop(0)
        else:
            index = self._replay() if self._replay_due() else None
            issue = Issue(self._walk(step) if index is None else index)
            self._num_issued += 1
        self._inflight[group] = issue
        return issue

    def _replay_due(self) -> bool:
        s = self._settings
        if not s.enabled or not s.replay_share:
            return False
        return self._num_replays < s.replay_share * (self._num_issued + 1)

    def _replay(self) -> int | None:
        busy = {issue.index for issue in self._inflight.values()}
        for i, index in enumerate(self._pool):
            if index not in busy:
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

    def _permute(self, epoch: int) -> list[int]:
        import numpy as np  # not on the config's import path

        rng = np.random.default_rng([self._seed, epoch])
        return [int(i) for i in rng.permutation(self._num_prompts)]

    # -- verdicts ---------------------------------------------------------------------------

    def in_flight(self, group: str) -> bool:
        """Whether `group` was issued and its verdict not heard yet."""
        return group in self._inflight

    def reissued(self, group: str) -> bool:
        """Whether `group`'s prompt was already re-issued, before a restart, by a verdict that
        this state never heard: whatever its verdict now, the group must not be trained."""
        return group in self._reissued

    def observe(self, group: str, step: int, valid_rewards: Sequence[float]) -> None:
        """`group` was judged at `step`, for the policy (kept, or without signal);
        `valid_rewards` are the rewards of its members that did not fail as infrastructure.
        A group not in flight (its verdict was heard before a restart) changes nothing."""
        issue = self._inflight.pop(group, None)
        if issue is None:
            return
        if len(valid_rewards) < 2:
            return  # failures say nothing about the prompt's difficulty
        index = issue.index
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

    def retry(self, group: str, cause: RetryCause, reason: str) -> Skipped | None:
        """`group` cannot be trained for `cause`, a reason outside the policy: its prompt is
        re-issued before any other (the next `next_issue`), or, once the issue has spent
        `retry.budget` re-issues, it is skipped, which is returned (and kept for
        `take_retries`). A group not in flight changes nothing."""
        issue = self._inflight.pop(group, None)
        if issue is None:
            return None
        if group in self._reissued:  # its re-issue was adopted on resume
            self._reissued.discard(group)
            self.retried[cause] += 1
            return None
        if issue.retry >= self._retry.budget:
            skipped = Skipped(issue.index, group, issue.retry, cause, reason)
            self.skipped.append(skipped)
            return skipped
        self._retries.append(Issue(issue.index, retry_of=group, retry=issue.retry + 1))
        self.retried[cause] += 1
        return None

    def in_flight_groups(self) -> list[str]:
        """The groups issued whose verdict was not heard yet, in name order."""
        return sorted(self._inflight)

    def adopt(self, group: str, issue: Issue) -> None:
        """`group`, of `issue`, was issued after the checkpoint this state comes from (read
        back from the TransferQueue): it counts as issued, as it was. A re-issue either was
        due here (decided before the checkpoint), or was decided after it, and then the group
        it re-issues is marked so that its verdict, heard again, re-issues nothing."""
        if issue.retry_of:
            due = [i for i, r in enumerate(self._retries) if r.retry_of == issue.retry_of]
            if due:
                del self._retries[due[0]]
            else:
                self._reissued.add(issue.retry_of)
        else:
            index = issue.index
            self._num_issued += 1
            busy = {i.index for i in self._inflight.values()}
            if index in self._pool and index not in busy:
                self._pool.remove(index)
                self._num_replays += 1
            elif self._prompts[index].covered_epoch != self._epoch:
                self._prompts[index].covered_epoch = self._epoch
            else:
                self._num_replays += 1
        self._inflight[group] = issue

    def take_set_aside(self) -> list[SetAside]:
        taken, self.set_aside = self.set_aside, []
        return taken

    def take_retries(self) -> tuple[Counter[str], list[Skipped]]:
        """Groups re-issued, by cause, and issues skipped, since the last call."""
        taken = (self.retried, self.skipped)
        self.retried, self.skipped = Counter(), []
        return taken

    # -- checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON: what a resumed trainer needs to issue as this one would. It includes the
        re-issues and skips not taken into a step record yet: a trainer stopped in the middle
        of a step saves them, and the step that re-runs records them."""
        return {
            "format": STATE_FORMAT,
            "num_prompts": self._num_prompts,
            "epoch": self._epoch,
            "position": self._position,
            "pool": list(self._pool),
            "inflight": {g: _issue_json(i) for g, i in sorted(self._inflight.items())},
            "retries": [_issue_json(i) for i in self._retries],
            "reissued": sorted(self._reissued),
            "retried": dict(self.retried),
            "skipped": [[s.index, s.group, s.retries, s.cause, s.reason] for s in self.skipped],
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
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                "the checkpoint's curriculum state is from an older relayrl (it does not name "
                "the groups in flight): resume it with that version, or start the run over"
            )
        if state["num_prompts"] != self._num_prompts:
            raise ValueError(
                f"the checkpoint's curriculum has {state['num_prompts']} prompts, the prompts "
                f"file {self._num_prompts}: resume with the prompts the run started with"
            )
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._permutation = self._permute(self._epoch)
        self._pool = [int(i) for i in state["pool"]]
        self._inflight = {str(g): _issue_of(i) for g, i in state["inflight"].items()}
        self._retries = [_issue_of(i) for i in state["retries"]]
        self._reissued = {str(g) for g in state["reissued"]}
        self.retried = Counter({str(k): int(v) for k, v in state["retried"].items()})
        self.skipped = [
            Skipped(int(i), str(g), int(n), c, str(r)) for i, g, n, c, r in state["skipped"]
        ]
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


def _issue_json(issue: Issue) -> list[Any]:
    return [issue.index, issue.retry_of, issue.retry]


def _issue_of(saved: list[Any]) -> Issue:
    index, retry_of, retry = saved
    return Issue(int(index), str(retry_of), int(retry))
