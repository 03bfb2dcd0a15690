"""Reward timing of a finished run, read back from the TransferQueue's event stream.

Every status transition is one entry of the partition's event stream (`<prefix>events`, see
relayrl.tq.queue), and a stream entry id is `<unix ms>-<seq>` stamped by Redis' clock, so the
stream says when each trajectory was put (`to=finished`, or `to=failed` for an infrastructure
failure during rollout) and when it was scored (`to=scored`), to the millisecond and on one
clock for every writer. A group `U` has the trajectories `U_0` ... `U_{n-1}`
(relayrl.tq.codec.trajectory_key).

For the trajectories of the groups a trainer step trained (the `uids` of its steps.jsonl
record):

    t_collect(step)     = max(0, last scored - last finished)
    overlap_ratio(step) = 1 - t_collect / (last scored - first finished)   (1.0 when that is 0)

t_collect is how long the trainer waited on reward after rollout of its groups had ended (the
reward work not hidden behind rollout); overlap_ratio is the share of the step's reward window
(first trajectory put to last one scored) that ran while rollout was still going. A failed
trajectory ends rollout like a finished one but is never scored. A step without any scored
trajectory (none of its events survive, or every one failed) has neither number.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from relayrl.core.records import Record, StepRecord, read_records

if TYPE_CHECKING:  # the report reads files only: no Redis client to import for it
    from relayrl.tq import TransferQueue

logger = logging.getLogger(__name__)

REWARD_TIMING_FILE = "reward_timing.jsonl"
STEPS_FILE = "trainer/steps.jsonl"
PAGE_SIZE = 10_000

_ROLLOUT_ENDS = frozenset({"finished", "failed"})


class RewardTiming(Record):
    """Reward timing of one trainer step (a line of `reward_timing.jsonl`). Times are unix
    seconds (ms resolution)."""

    step: int
    num_groups: int
    num_groups_without_events: int  # trained groups of which the stream holds no trajectory
    num_trajectories: int  # trajectories put (finished or failed) with an event
    num_failed: int  # put as failed: infrastructure failures during rollout
    num_scored: int
    first_finished_time: float | None
    last_finished_time: float | None
    last_scored_time: float | None
    t_collect_s: float | None
    overlap_ratio: float | None


def step_timing(
    step: int,
    uids: Sequence[str],
    finished_times: dict[str, dict[str, tuple[float, bool]]],
    scored_times: dict[str, dict[str, float]],
) -> RewardTiming:
    """Reward timing of `step` from the per-group event times: `finished_times[uid][key]` is
    (time the trajectory was put, whether it was put as failed), `scored_times[uid][key]` the
    time it was scored."""
    ends: list[float] = []
    scores: list[float] = []
    num_failed = 0
    num_without = 0
    for uid in uids:
        put = finished_times.get(uid, {})
        scored = scored_times.get(uid, {})
        if not put and not scored:
            num_without += 1
        ends += [t for t, _ in put.values()]
        num_failed += sum(failed for _, failed in put.values())
        scores += list(scored.values())
    first_finished = min(ends, default=None)
    last_finished = max(ends, default=None)
    last_scored = max(scores, default=None)
    t_collect = overlap = None
    if last_scored is not None and last_finished is not None and first_finished is not None:
        t_collect = max(0.0, last_scored - last_finished)
        span = last_scored - first_finished
        overlap = 1.0 - t_collect / span if span > 0 else 1.0
    return RewardTiming(
        step=step,
        num_groups=len(uids),
        num_groups_without_events=num_without,
        num_trajectories=len(ends),
        num_failed=num_failed,
        num_scored=len(scores),
        first_finished_time=first_finished,
        last_finished_time=last_finished,
        last_scored_time=last_scored,
        t_collect_s=t_collect,
        overlap_ratio=overlap,
    )


def _entry_time(entry_id: str) -> float:
    return int(entry_id.partition("-")[0]) / 1000.0


def reward_timing(
    tq: TransferQueue,
    partition: str,
    steps: Sequence[tuple[int, Sequence[str]]],
    *,
    page_size: int = PAGE_SIZE,
) -> list[RewardTiming]:
    """Reward timing of each (step, trained group uids) in `steps`, in that order, from one pass
    over the partition's event stream (XRANGE in pages of `page_size`). Only the events of the
    named groups are kept in memory. If a trajectory has several events of a kind (a reused
    namespace), its first one counts."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    wanted = {uid for _, uids in steps for uid in uids}
    finished_times: dict[str, dict[str, tuple[float, bool]]] = {}
    scored_times: dict[str, dict[str, float]] = {}
    start = "-"
    num_events = 0
    while True:
        events = tq.read_events(partition, start, page_size)
        for event in events:
            if event.kind != "trajectory":
                continue
            uid = event.key.rpartition("_")[0]
            if uid not in wanted:
                continue
            if event.to_status in _ROLLOUT_ENDS:
                times = finished_times.setdefault(uid, {})
                if event.key not in times:
                    times[event.key] = (_entry_time(event.id), event.to_status == "failed")
            elif event.to_status == "scored":
                scored_times.setdefault(uid, {}).setdefault(event.key, _entry_time(event.id))
        num_events += len(events)
        if len(events) < page_size:
            break
        start = "(" + events[-1].id  # exclusive: the next page starts after the last entry
    logger.info("reward timing: read %d events of partition %s", num_events, partition)
    return [step_timing(step, uids, finished_times, scored_times) for step, uids in steps]


def steps_from_log(path: Path) -> list[tuple[int, list[str]]]:
    """(step, trained group uids) of every record of a trainer steps.jsonl."""
    return [(record.step, record.uids) for record in read_records(path, StepRecord)]


def write_reward_timing(run_dir: Path, timings: Sequence[RewardTiming]) -> Path:
    """Writes `run_dir/reward_timing.jsonl`, one RewardTiming per line."""
    path = run_dir / REWARD_TIMING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for timing in timings:
            f.write(timing.to_line() + "\n")
    return path


def read_reward_timing(run_dir: Path) -> list[RewardTiming]:
    """The records of `run_dir/reward_timing.jsonl` (relayrl.core.records.read_records)."""
    return read_records(run_dir / REWARD_TIMING_FILE, RewardTiming)


def collect_reward_timing(tq: TransferQueue, partition: str, run_dir: Path) -> Path:
    """After a run: reward timing of every step of `run_dir/trainer/steps.jsonl`, written to
    `run_dir/reward_timing.jsonl`."""
    steps = steps_from_log(run_dir / STEPS_FILE)
    return write_reward_timing(run_dir, reward_timing(tq, partition, steps))
