"""`relayrl audit RUN_DIR`: what a stopped run did with every prompt group and weight version,
checked against relayrl's three promises (docs/recovery.md):

- no group trained twice: a group appears in the last record of at most one trainer step,
  and the TransferQueue marks it consumed at exactly that step;
- no group lost: nothing is stuck where no component will ever move it -- a running group
  without a lease, a finished trajectory whose event no consumer group will deliver, a group
  consumed at a step that did not train it although that step's own verdicts (staleness, no
  valid member, the DAPO filter) would have kept it;
- no prompt lost: every issue of a prompt by the trainer's feeder ends in exactly one way
  (docs/algorithms.md#retries). Its groups form a chain, each re-issue naming the group before
  it (`retry_of`); the chain's last group was trained, was judged without signal (the
  policy's outcome), was given up after the retry budget (`skipped` in its step's record), or
  is still in play at the run's end. A group that could not be trained for a reason outside
  the policy (no valid member, one valid member, too stale, dropped) and has no re-issue and
  no skip is a prompt silently lost; a group re-issued twice, or re-issued although trained,
  is an issue trained twice;
- no stale weights served: every generated span carries the weight version of the engine
  that sampled it (the engine's own label), and that version was the committed one at some
  moment while the trajectory ran (an engine serving its initial weights after a newer
  version was committed, or any version that never committed, is caught here); every
  held-out evaluation likewise ran on a committed version.

The run's Redis is started again on its AOF, on a free port, for the audit (the run must be
stopped). Groups still pending or scored when the run ended were issued ahead and are left
over, not lost.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relayrl.core.records import EvalRecord, StepRecord, TransferRecord, read_records
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import PartitionSnapshot, TransferQueue
from relayrl.tq.model import GroupStatus
from relayrl.tq.server import RedisServer

NAMESPACE, PARTITION = "relayrl", "train"
CLOCK_SLACK_S = 1.0
"""Tolerance between the gateway's and weight-sync's timestamps (one machine, one clock)."""


@dataclass
class AuditReport:
    statuses: Counter[str] = field(default_factory=Counter)
    num_trained: int = 0
    trained_twice: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    stale_served: list[str] = field(default_factory=list)
    num_spans: int = 0
    spans_by_version: Counter[int] = field(default_factory=Counter)
    num_infra_trajectories: int = 0
    left_over: int = 0
    prompts: Counter[str] = field(default_factory=Counter)  # issues, by how they ended
    num_retries: int = 0  # groups that re-issue another's prompt
    prompts_lost: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.trained_twice or self.lost or self.stale_served or self.prompts_lost)

    def summary(self) -> str:
        statuses = " ".join(f"{k}={v}" for k, v in sorted(self.statuses.items()))
        return (
            f"audit: groups {statuses}; trained={self.num_trained} "
            f"trained_twice={len(self.trained_twice)} lost={len(self.lost)} "
            f"stale_served={len(self.stale_served)} (of {self.num_spans} spans) "
            f"infra_trajectories={self.num_infra_trajectories} left_over={self.left_over}; "
            f"prompts issued={self.prompts.total()} retried={self.num_retries} "
            f"prompts_skipped={self.prompts['skipped']} prompts_lost={len(self.prompts_lost)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "statuses": dict(self.statuses),
            "num_trained": self.num_trained,
            "trained_twice": self.trained_twice,
            "lost": self.lost,
            "stale_served": self.stale_served,
            "num_spans": self.num_spans,
            "spans_by_version": {str(v): n for v, n in sorted(self.spans_by_version.items())},
            "num_infra_trajectories": self.num_infra_trajectories,
            "left_over": self.left_over,
            "prompts": dict(self.prompts),
            "num_retries": self.num_retries,
            "prompts_lost": self.prompts_lost,
        }


class CommitTimeline:
    """Which version was committed when: version 0 (the initial weights) until the first
    commit, then each committed version until the next commit (a resumed trainer's supersede
    may go back to an older number)."""

    def __init__(self, commits: list[tuple[float, int]]) -> None:
        commits = sorted(commits)
        self._times = [t for t, _ in commits]
        self._versions = [v for _, v in commits]

    @classmethod
    def of_run(cls, run_dir: Path) -> CommitTimeline:
        records = read_records(run_dir / "weightsync" / "transfers.jsonl", TransferRecord)
        return cls([(r.time, r.version) for r in records if r.state == "committed"])

    def committed_during(self, start: float, end: float) -> set[int]:
        """Versions that were the committed one at some moment of [start, end]."""
        first = bisect.bisect_right(self._times, start) - 1
        last = bisect.bisect_right(self._times, end) - 1
        versions = {0} if first < 0 else set()
        return versions | {self._versions[i] for i in range(max(first, 0), last + 1)}


def audit_run(run_dir: Path) -> AuditReport:
    """Audits a stopped run (see the module docstring)."""
    report = AuditReport()
    records = _final_records(run_dir)
    trained = _trained_by_step(records, report)
    rules = StepRules.of_run(run_dir)
    consumer_group = _reward_consumer_group(run_dir)
    timeline = CommitTimeline.of_run(run_dir)
    server = RedisServer(run_dir / "redis")
    server.start(timeout_s=120)
    try:
        tq = TransferQueue(server.client(), namespace=NAMESPACE, durability="off")
        try:
            snapshot = tq.audit_snapshot(PARTITION)
        finally:
            tq.close()
    finally:
        server.stop()
    groups = snapshot.groups
    alive_events = _undelivered_or_pending(snapshot, consumer_group)
    leases = {lease.uid for lease in snapshot.leases}
    reissues = _reissues(groups)
    for uid, group in groups.items():
        status = common_pb2.GroupStatus.Name(group.group.tags.status).removeprefix("GROUP_STATUS_")
        report.statuses[status.lower()] += 1
        _check_group(uid, group, trained, rules, leases, alive_events, timeline, reissues, report)
    PromptAccount(groups, reissues, trained, records, rules).check(report)
    for uid, step in trained.items():
        if uid not in groups:
            report.lost.append(f"{uid}: trained at step {step} but not in the TransferQueue")
    _check_evaluations(run_dir, timeline, report)
    return report


def _final_records(run_dir: Path) -> dict[int, StepRecord]:
    """The last record of every step (a step re-run after a trainer restart is logged again;
    its last record is the one that counts)."""
    return {r.step: r for r in read_records(run_dir / "trainer" / "steps.jsonl", StepRecord)}


def _trained_by_step(final: dict[int, StepRecord], report: AuditReport) -> dict[str, int]:
    """uid -> the step that trained it, from the last record of every step."""
    trained: dict[str, int] = {}
    for step, record in sorted(final.items()):
        for uid in record.uids:
            if uid in trained:
                report.trained_twice.append(f"{uid}: trained at steps {trained[uid]} and {step}")
            trained[uid] = step
    report.num_trained = len(trained)
    return trained


def _service_config(run_dir: Path, service: str) -> dict[str, Any]:
    path = run_dir / "services" / service / f"relayrl-{service}.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else {}


@dataclass(frozen=True)
class StepRules:
    """What made the trainer consume a group without training on it (its step's verdicts)."""

    staleness_threshold: int = 1
    dapo_filter: bool = True
    staleness_policy: str = "drop"

    @classmethod
    def of_run(cls, run_dir: Path) -> StepRules:
        from relayrl.trainer.config import TrainerConfig

        config = _service_config(run_dir, "trainer")
        if not config:
            return cls()
        trainer = TrainerConfig.model_validate(config)
        algorithm = trainer.algorithm
        return cls(trainer.staleness_threshold, algorithm.dapo_filter, algorithm.staleness.policy)

    def rejected(self, group: Any, step: int) -> bool:
        """Whether the step judged the group unusable: too stale, or not kept by the
        trainer's own verdict (`judge_group`)."""
        return self.verdict(group, step) != "keep"

    def verdict(self, group: Any, step: int) -> str:
        """The step's verdict on a group it consumed: stale (only the `drop` policy judges so),
        or `judge_group`'s."""
        from relayrl.trainer.replay import judge_group

        stale = step - group.group.tags.prompt_step + 1 > self.staleness_threshold
        if stale and self.staleness_policy == "drop":
            return "stale"
        return judge_group(group, use_dapo_filter=self.dapo_filter)


def _reward_consumer_group(run_dir: Path) -> str:
    return str(
        _service_config(run_dir, "reward").get("tq_scorer", {}).get("consumer_group", "reward")
    )


def _undelivered_or_pending(snapshot: PartitionSnapshot, group: str) -> set[str]:
    """Keys whose trajectory-finished event the reward group will still deliver (pending, or
    not delivered yet)."""
    state = snapshot.consumer_groups.get(group)
    if state is None:
        return {e.key for e in snapshot.events}  # it reads from 0
    last = state.last_delivered_id
    pending = {p.id for p in state.pending}
    alive = set()
    for event in snapshot.events:
        finished = event.kind == "trajectory" and event.to_status == "finished"
        if finished and (event.id in pending or _id_after(event.id, last)):
            alive.add(event.key)
    return alive


def _id_after(a: str, b: str) -> bool:
    a_ms, a_seq = (int(x) for x in a.split("-"))
    b_ms, b_seq = (int(x) for x in b.split("-"))
    return (a_ms, a_seq) > (b_ms, b_seq)


def _reissues(groups: dict[str, Any]) -> dict[str, list[str]]:
    """uid -> the groups that re-issue its prompt (normally none or one)."""
    out: dict[str, list[str]] = {}
    for uid, group in sorted(groups.items()):
        if group.group.retry_of:
            out.setdefault(group.group.retry_of, []).append(uid)
    return out


def _check_group(
    uid: str,
    group: Any,
    trained: dict[str, int],
    rules: StepRules,
    leases: set[str],
    alive_events: set[str],
    timeline: CommitTimeline,
    reissues: dict[str, list[str]],
    report: AuditReport,
) -> None:
    tags = group.group.tags
    status = GroupStatus(
        common_pb2.GroupStatus.Name(tags.status).removeprefix("GROUP_STATUS_").lower()
    )
    report.num_infra_trajectories += sum(1 for t in group.trajectories if t.tags.is_infra)
    if status is GroupStatus.CONSUMED:
        step = tags.consumed_step
        if uid in trained and trained[uid] != step:
            report.trained_twice.append(
                f"{uid}: trained at step {trained[uid]}, consumed in the queue at step {step}"
            )
        # a group whose prompt was re-issued before a trainer restart is judged stale after it
        # (docs/recovery.md#prompts-across-a-restart), whatever it holds
        if uid not in trained and uid not in reissues and not rules.rejected(group, step):
            report.lost.append(
                f"{uid}: consumed at step {step} and usable there (fresh, with a signal), but "
                "no step trained it"
            )
    elif uid in trained:
        report.trained_twice.append(f"{uid}: trained at step {trained[uid]} but {status.value}")
    if status is GroupStatus.RUNNING and uid not in leases:
        report.lost.append(f"{uid}: running without a lease (nothing returns it to pending)")
    if status is GroupStatus.FINISHED:
        for t in group.trajectories:
            key = f"{t.uid}_{t.index}"
            if t.tags.status == common_pb2.TRAJECTORY_STATUS_FINISHED and key not in alive_events:
                report.lost.append(f"{key}: finished, never scored, and no event will deliver it")
    if status in (
        GroupStatus.PENDING,
        GroupStatus.SCORED,
        GroupStatus.FINISHED,
        GroupStatus.RUNNING,
    ):
        report.left_over += 1
    for t in group.trajectories:
        _check_spans(t, timeline, report)


def _check_spans(t: common_pb2.Trajectory, timeline: CommitTimeline, report: AuditReport) -> None:
    spans = [s for s in t.spans if s.generated]
    if not spans:
        return
    start = t.timings.started_at.ToNanoseconds() / 1e9 - CLOCK_SLACK_S
    end = t.timings.finished_at.ToNanoseconds() / 1e9 + CLOCK_SLACK_S
    committed = timeline.committed_during(start, end)
    for span in spans:
        report.num_spans += 1
        report.spans_by_version[span.policy_version] += 1
        if span.policy_version not in committed:
            report.stale_served.append(
                f"{t.uid}_{t.index} tokens [{span.start}, {span.end}) on {span.replica or '?'}: "
                f"version {span.policy_version}, committed meanwhile: {sorted(committed)}"
            )


def _check_evaluations(run_dir: Path, timeline: CommitTimeline, report: AuditReport) -> None:
    for record in read_records(run_dir / "eval.jsonl", EvalRecord):
        if record.failed:  # it measured nothing, on no version (-1)
            continue
        end = record.time + CLOCK_SLACK_S
        start = end - record.seconds - 2 * CLOCK_SLACK_S
        committed = timeline.committed_during(start, end)
        for version in (record.version, record.version_end):
            if version not in committed:
                report.stale_served.append(
                    f"held-out evaluation ({record.kind}, step {record.step}) on "
                    f"version {version}, committed meanwhile: {sorted(committed)}"
                )


RETRY_VERDICTS = ("stale", "no_valid", "one_valid")
IN_PLAY = frozenset(
    {GroupStatus.PENDING, GroupStatus.RUNNING, GroupStatus.FINISHED, GroupStatus.SCORED}
)


@dataclass
class PromptAccount:
    """How every issue of a prompt by the trainer's feeder ended (the groups with a
    `prompt_key`), from the queue's groups and the steps' last records."""

    groups: dict[str, Any]
    reissues: dict[str, list[str]]
    trained: dict[str, int]
    records: dict[int, StepRecord]
    rules: StepRules

    def check(self, report: AuditReport) -> None:
        skipped = {s.uid: s for r in self.records.values() for s in r.skipped}
        for uid, group in sorted(self.groups.items()):
            if not group.group.prompt_key:
                continue  # not the feeder's
            if group.group.retry_of:
                report.num_retries += 1
                self._check_link(uid, group, report)
            else:
                end, last = self._end_of_issue(uid, skipped, report)
                report.prompts[end] += 1
                if end == "lost":
                    report.prompts_lost.append(last)

    def _check_link(self, uid: str, group: Any, report: AuditReport) -> None:
        before = self.groups.get(group.group.retry_of)
        if before is None:
            report.prompts_lost.append(
                f"{uid}: re-issues {group.group.retry_of}, which the TransferQueue does not hold"
            )
        elif (group.group.prompt_key, group.group.retry) != (
            before.group.prompt_key,
            before.group.retry + 1,
        ):
            report.prompts_lost.append(
                f"{uid}: re-issues {before.group.uid} (prompt {before.group.prompt_key}, re-issue "
                f"{before.group.retry}) as prompt {group.group.prompt_key}, re-issue "
                f"{group.group.retry}"
            )

    def _end_of_issue(
        self, root: str, skipped: dict[str, Any], report: AuditReport
    ) -> tuple[str, str]:
        """How the issue that `root` began ended (trained, without_signal, skipped, in_play or
        lost), and, when lost, why; an issue trained twice is reported as such."""
        uid = root
        while True:
            nxt = self.reissues.get(uid, [])
            end = self._end_of_group(uid)
            if len(nxt) > 1:
                report.trained_twice.append(f"{uid}: its prompt re-issued {len(nxt)} times {nxt}")
            if nxt and end in ("trained", "without_signal"):
                report.trained_twice.append(f"{uid}: {end}, and its prompt re-issued as {nxt[0]}")
            if not nxt:
                break
            uid = nxt[0]
        if end in ("trained", "without_signal", "in_play"):
            return end, ""
        if uid in skipped:
            return "skipped", ""
        prompt = self.groups[uid].group.prompt_key
        return "lost", (
            f"{uid}: prompt {prompt}, {end}, neither re-issued nor recorded as skipped"
            + (f" (its issue began with {root})" if uid != root else "")
        )

    def _end_of_group(self, uid: str) -> str:
        """trained, without_signal, in_play, or the reason outside the policy that it was not
        trained (stale, no_valid, one_valid, dropped, failed)."""
        if uid in self.trained:
            return "trained"
        group = self.groups[uid]
        tags = group.group.tags
        status = GroupStatus(
            common_pb2.GroupStatus.Name(tags.status).removeprefix("GROUP_STATUS_").lower()
        )
        if status in IN_PLAY:
            return "in_play"
        if status is not GroupStatus.CONSUMED:
            return status.value  # dropped (by the staleness gate, or before a restart), failed
        if tags.consumed_step not in self.records:
            return "in_play"  # a step that never completed: its groups go back on resume
        verdict = self.rules.verdict(group, tags.consumed_step)
        if verdict == "no_signal":
            return "without_signal"
        if verdict in RETRY_VERDICTS:
            return verdict
        return f"usable at step {tags.consumed_step} but not trained"  # lost, see _check_group
