"""Sampling one step's prompt groups from the TransferQueue, with the staleness gate
(docs/staleness.md#consumption-gate) and the filter's budget (docs/algorithms.md#filter-budget).

staleness(group, step) = step - prompt_step + 1 (data issued at this step has staleness 1).

- `drop`: before consuming, finished and scored groups with staleness > threshold are evicted
  (-> dropped) and refilled;
- `wait`: sampling blocks while any in-flight (pending or running) group has staleness >=
  threshold, so that it finishes and is trained on instead of growing staler.

Count-based throttling bounds the mean staleness, not the max
(docs/staleness.md#why-the-gate-is-needed), so the bound is also enforced at consumption: a group
that became scored between eviction and consumption above the threshold is consumed (the
TransferQueue records that this step took it) but not trained on.

A step that has consumed `filter_budget` times its batch and kept at least one group trains on
what it kept: a filter without a budget starves a step whose groups mostly have no signal.
While it waits, the leader's `ProgressWatch` reports and applies the stop rules
(relayrl.trainer.progress).

Consumption is the TransferQueue's `consume(step, n)`, which is idempotent per step: a trainer
that crashed mid-step and restarts the same step gets the same groups back, topped up.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.core.outage import Outage
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.model import GroupStatus, GroupWithTrajectories
from relayrl.tq.queue import TQUnavailableError
from relayrl.trainer.advantages import GroupRewards, dapo_filter
from relayrl.trainer.batch import is_valid
from relayrl.trainer.progress import ProgressWatch

# A group is kept, or rejected for one of these reasons; `credit` is how many new prompts the
# feeder issues for it (docs/algorithms.md#refill-credit): one per evicted or failed group,
# refill_per_filtered per group without signal. `stale`, `no_valid` and `one_valid` are reasons
# outside the policy: the feeder re-issues the group's prompt (docs/algorithms.md#retries), and
# that re-issue is the one new prompt. `no_signal` is the policy's own outcome.
Verdict = str  # "keep" | "stale" | "no_signal" | "no_valid" | "one_valid"


def judge_group(group: GroupWithTrajectories, *, use_dapo_filter: bool) -> Verdict:
    """What a step does with a fresh group: no_valid when every member failed as
    infrastructure; one_valid when one member of several is valid (the others failed, so there
    is nothing to compare, whatever the filter); no_signal when, with the DAPO filter on, the
    valid rewards are equal; keep otherwise (a group of one is kept with the filter off). The
    trainer and `relayrl audit` both judge by this."""
    valid = [is_valid(t) for t in group.trajectories]
    if not any(valid):
        return "no_valid"
    if sum(valid) < 2 and len(valid) > 1:
        return "one_valid"
    if not use_dapo_filter:
        return "keep"
    rewards = GroupRewards(
        group.group.uid,
        [t.reward.score for t in group.trajectories],
        [not v for v in valid],
    )
    return "keep" if dapo_filter([rewards]).kept else "no_signal"


class SamplingStopped(Exception):
    """The trainer was asked to stop while it waited for data. The groups this step already
    consumed go back to scored when the next run restores the last checkpoint."""


@dataclass
class Sample:
    kept: list[GroupWithTrajectories]
    rejected: Counter[str] = field(default_factory=Counter)
    num_consumed: int = 0
    num_evicted: int = 0
    waited_s: float = 0.0
    blocked_s: float = 0.0
    budget_spent: bool = False
    """The step trains on fewer groups than its batch: the filter's budget ran out."""


class ReplaySampler:
    def __init__(
        self,
        tq: TransferQueue,
        partition: str,
        *,
        policy: str,
        threshold: int,
        poll_interval_s: float,
        watch: ProgressWatch,
        refill_per_filtered: int = 1,
        filter_budget: float | None = None,
        outage_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`outage_timeout_s`: how long a lost Redis is waited out within one `sample`;
        `filter_budget`: groups consumed per group of the batch before a step trains on what
        it kept (None: no budget)."""
        if policy not in ("drop", "wait"):
            raise ValueError(f"unknown staleness policy {policy!r}; known: drop, wait")
        self._tq = tq
        self._partition = partition
        self._policy = policy
        self._threshold = threshold
        self._poll_interval_s = poll_interval_s
        self._watch = watch
        self._refill_per_filtered = refill_per_filtered
        self._filter_budget = filter_budget
        self._clock = clock
        self._sleep = sleep
        self._outage_timeout_s = outage_timeout_s

    def staleness(self, prompt_step: int, step: int) -> int:
        return step - prompt_step + 1

    def evict_stale(self, step: int) -> list[common_pb2.PromptGroup]:
        """drop: finished/scored groups with staleness > threshold -> dropped; the groups."""
        stale = self._tq.groups_issued_by(
            self._partition,
            (GroupStatus.FINISHED, GroupStatus.SCORED),
            max_prompt_step=step - self._threshold,
        )
        uids = [u for uids in stale.values() for u in uids]
        if not uids:
            return []
        groups = self._tq.get_groups(self._partition, uids, with_trajectories=False)
        self._tq.drop_groups(self._partition, uids, f"stale at step {step}")
        return [g.group for g in groups]

    def blocked(self, step: int) -> bool:
        """wait: an in-flight group has staleness >= threshold."""
        inflight = self._tq.groups_issued_by(
            self._partition,
            (GroupStatus.PENDING, GroupStatus.RUNNING),
            max_prompt_step=step + 1 - self._threshold,
        )
        return any(inflight.values())

    def sample(
        self,
        step: int,
        num_groups: int,
        judge: Callable[[GroupWithTrajectories], Verdict],
        refill: Callable[[int], None],
        stop: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], None] = lambda: None,
        discard: Callable[[list[common_pb2.PromptGroup]], None] = lambda groups: None,
    ) -> Sample:
        """Consumes groups at `step` until `num_groups` of them are kept by `judge` (after the
        staleness bound). `refill(n)` asks the feeder for n more prompts: 1 per evicted or
        failed group, `refill_per_filtered` per group without signal. `on_wait()` runs
        before every sleep (the leader re-announces its step to rollout from there);
        `discard(groups)` hears of the groups the gate evicts or rejects as stale, which
        `judge` never sees, after they are out of play."""
        out = Sample(kept=[])
        seen: set[str] = set()
        start = self._clock()
        outage = Outage(
            f"the TransferQueue (sampling step {step})",
            self._outage_timeout_s,
            clock=self._clock,
            sleep=self._sleep,
        )
        while True:
            if stop():
                raise SamplingStopped(f"stopped while sampling step {step}")
            try:
                done = self._sample_once(
                    step, num_groups, judge, refill, on_wait, discard, out, seen
                )
            except TQUnavailableError as exc:
                # Every call of a round is safe to repeat: consume is idempotent per step, and
                # a group counts as seen only once judged.
                outage.failed(exc)
                continue
            outage.recovered()
            if done:
                break
        out.waited_s = self._clock() - start
        return out

    def _sample_once(
        self,
        step: int,
        num_groups: int,
        judge: Callable[[GroupWithTrajectories], Verdict],
        refill: Callable[[int], None],
        on_wait: Callable[[], None],
        discard: Callable[[list[common_pb2.PromptGroup]], None],
        out: Sample,
        seen: set[str],
    ) -> bool:
        """One round of `sample`; whether the step has its groups."""
        if self._policy == "wait" and self.blocked(step):
            self._wait(step, num_groups, out, on_wait)
            out.blocked_s += self._poll_interval_s
            return False
        if self._policy == "drop":
            evicted = self.evict_stale(step)
            if evicted:
                out.num_evicted += len(evicted)
                discard(evicted)
                refill(len(evicted))
        need = num_groups - len(out.kept)
        if need <= 0:
            return True
        if self._budget_spent(num_groups, out):
            out.budget_spent = True
            return True
        uids = self._tq.consume(self._partition, step, len(seen) + need)
        fresh = [u for u in uids if u not in seen]
        if not fresh:
            self._wait(step, num_groups, out, on_wait)
            return False
        groups = self._tq.get_groups(self._partition, fresh)
        seen.update(fresh)
        out.num_consumed += len(fresh)
        credit = 0
        stale = []
        for group in groups:
            verdict = self._verdict(group, step, judge)
            self._watch.observe(group, verdict)
            if verdict == "keep":
                out.kept.append(group)
            else:
                out.rejected[verdict] += 1
                credit += self._refill_per_filtered if verdict == "no_signal" else 1
            if verdict == "stale":
                stale.append(group.group)
        if stale:
            discard(stale)
        if credit:  # after the verdicts are recorded: a failing refill loses none of them
            refill(credit)
        # groups may keep coming and keep failing: the stop rules apply while they do
        self._watch.waiting(step, num_groups, len(out.kept), out.num_consumed)
        return False

    def _verdict(
        self,
        group: GroupWithTrajectories,
        step: int,
        judge: Callable[[GroupWithTrajectories], Verdict],
    ) -> Verdict:
        if self._policy == "drop" and (
            self.staleness(group.group.tags.prompt_step, step) > self._threshold
        ):
            return "stale"
        return judge(group)

    def _budget_spent(self, num_groups: int, out: Sample) -> bool:
        """The step has consumed its budget and kept something to train on."""
        budget = self._filter_budget
        return budget is not None and bool(out.kept) and out.num_consumed >= budget * num_groups

    def _wait(self, step: int, num_groups: int, out: Sample, on_wait: Callable[[], None]) -> None:
        """Nothing new to judge: report (and apply the stop rules), then sleep a poll."""
        self._watch.waiting(step, num_groups, len(out.kept), out.num_consumed)
        on_wait()
        self._sleep(self._poll_interval_s)
