"""Whether training makes progress, and why not (docs/progress.md).

A step waits for scored groups. While it waits, `ProgressWatch` tells, every
`report_interval_s`, what the wait has produced: groups kept and rejected with their reasons,
and rollouts that failed as infrastructure with the most common reason. It ends the run with
`NoProgress` (the trainer exits with `EXIT_NO_PROGRESS`, which a supervisor does not restart:
a restarted trainer would wait for the same thing) when either rule fires:

- stall: no step has completed for max(`stall_min_s`, `stall_step_factor` x the median step
  time of this process);
- infrastructure: at least `infra_fraction` of the last `infra_window` rollouts failed as
  infrastructure, and have for longer than `infra_grace_s`, so that a fault that heals within
  the services' own recovery bounds (an engine restart, a Redis restart) never trips it.

Both the trainer's log and `relayrl up`'s console print the same `ProgressRecord` line; the
records also go to a JSONL file that `relayrl up` follows (`ProgressLog`).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal, NoReturn

from pydantic import Field

from relayrl.core.config import StrictModel

if TYPE_CHECKING:  # the settings are read before any of these is imported
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.tq.model import GroupWithTrajectories

logger = logging.getLogger(__name__)

EXIT_NO_PROGRESS = 3
"""The trainer's exit code when a stop rule fired; its cause is the last `stopped` record."""

REASON_CHARS = 160


class ProgressConfig(StrictModel):
    """How a waiting step reports, and when a run that cannot progress ends."""

    report_interval_s: float = Field(
        30.0, gt=0, le=3600, description="A waiting step reports what it has this often."
    )
    stall_min_s: float = Field(
        600.0,
        gt=0,
        description="Stop rule: no step for max(this, stall_step_factor x the median step "
        "time) ends the run (exit code 3).",
    )
    stall_step_factor: float = Field(5.0, ge=1.0, le=1000.0, description="See stall_min_s.")
    infra_window: int = Field(
        200, ge=1, le=1_000_000, description="Stop rule: the last this many rollouts..."
    )
    infra_fraction: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description="... of which at least this share failed as infrastructure end the run.",
    )
    infra_grace_s: float = Field(
        120.0,
        ge=0.0,
        description="The infrastructure rule fires only once the failures have gone on this "
        "long: longer than a restart of any part takes to heal (docs/recovery.md).",
    )
    log: Path | None = Field(
        None, description="JSONL file that receives every progress record (waiting, stopped)."
    )

    @property
    def collective_timeout_s(self) -> float:
        """How long the other ranks wait in a collective while rank 0 waits for data: past
        every stall limit that a median step under an hour can set."""
        return max(3600.0, self.stall_min_s) * self.stall_step_factor


class NoProgress(RuntimeError):
    """A stop rule fired; the message is the cause, in one line."""


@dataclass
class ProgressRecord:
    """What a waiting step has, or why the run stopped (`kind` stopped, with `cause`)."""

    kind: Literal["waiting", "stopped"]
    step: int
    waited_s: float
    wanted: int
    kept: int = 0
    consumed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    no_signal: dict[str, int] = field(default_factory=dict)
    """Why groups had no signal: `all scored <r>`, or `fewer than two valid answers` (a group
    of one sample; one valid member of several is the verdict `one_valid`)."""
    rollouts: int = 0
    failed_rollouts: int = 0
    top_failure: str = ""
    top_failure_count: int = 0
    cause: str = ""
    time: float = 0.0

    def line(self) -> str:
        """One line for a person: `step 4 waiting 1m30s: 3 of 16 groups kept; ...`."""
        if self.kind == "stopped":
            return f"no progress: {self.cause}"
        parts = [f"{self.kept} of {self.wanted} groups kept"]
        if self.rejected:
            parts.append("rejected " + self.rejected_text())
        if self.failed_rollouts:
            parts.append(self.failures_text())
        elif not self.consumed:
            parts.append("no scored group yet")
        return f"step {self.step} waiting {_duration(self.waited_s)}: " + "; ".join(parts)

    def rejected_text(self) -> str:
        out = []
        for verdict, count in sorted(self.rejected.items(), key=lambda kv: -kv[1]):
            text = f"{verdict} {count}"
            if verdict == "no_signal" and self.no_signal:
                detail = ", ".join(
                    f"{why} {n}" for why, n in sorted(self.no_signal.items(), key=lambda kv: -kv[1])
                )
                text += f" ({detail})"
            out.append(text)
        return ", ".join(out)

    def failures_text(self) -> str:
        return (
            f"{self.failed_rollouts} of {self.rollouts} rollouts failed (most common, "
            f"{self.top_failure_count}x: {self.top_failure})"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProgressRecord:
        return cls(**json.loads(text))


class ProgressLog:
    """The JSONL file of progress records: the trainer appends, `relayrl up` follows. A line
    cut by a crash (no newline yet, or not JSON) is skipped, never an error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._out: IO[str] | None = None

    def append(self, record: ProgressRecord) -> None:
        if self._out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.path.open("a", encoding="utf-8")
        self._out.write(record.to_json() + "\n")
        self._out.flush()

    def new_records(self) -> list[ProgressRecord]:
        """The records appended since the last call."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        return list(_parse(data[:end].decode(errors="replace").splitlines()))

    def read_all(self) -> list[ProgressRecord]:
        if not self.path.exists():
            return []
        return list(_parse(self.path.read_text(errors="replace").splitlines()))

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def _parse(lines: Iterable[str]) -> Iterator[ProgressRecord]:
    for line in lines:
        try:
            yield ProgressRecord.from_json(line)
        except (ValueError, TypeError):
            continue


def failure_reason(trajectory: common_pb2.Trajectory) -> str | None:
    """Why a rollout failed as infrastructure (its first line), or None when it did not."""
    from relayrl.proto.common.v1 import common_pb2
    from relayrl.tq.model import INFRA_REWARD_STATUSES

    if trajectory.tags.is_infra or trajectory.tags.status == common_pb2.TRAJECTORY_STATUS_FAILED:
        text = trajectory.error or "rollout failed (no reason given)"
    elif trajectory.reward.status in INFRA_REWARD_STATUSES:
        status = common_pb2.RewardStatus.Name(trajectory.reward.status)
        text = f"reward {status.removeprefix('REWARD_STATUS_')}: {trajectory.reward.message}"
    else:
        return None
    first = text.strip().splitlines()[0] if text.strip() else text
    return first[:REASON_CHARS]


def group_failure_text(group: GroupWithTrajectories) -> str:
    """Why a group's members failed, in words: `3 of 4 rollouts failed (most common, 3x: ...)`."""
    reasons = Counter(r for t in group.trajectories if (r := failure_reason(t)) is not None)
    total = len(group.trajectories)
    if not reasons:
        return f"no valid member of {total}"
    reason, count = reasons.most_common(1)[0]
    return f"{reasons.total()} of {total} rollouts failed (most common, {count}x: {reason})"


def no_signal_reason(valid_rewards: list[float]) -> str:
    """Why a group whose valid rewards cannot be compared has no signal."""
    if len(valid_rewards) < 2:
        return "fewer than two valid answers"
    return f"all scored {valid_rewards[0]:g}"


@dataclass(frozen=True)
class StepTally:
    """What one step consumed, for its record."""

    no_signal: dict[str, int]  # why groups had no signal -> groups
    failures: dict[str, int]  # infrastructure failure reason -> rollouts
    # verdict -> generated response tokens of its groups; "no_signal" also holds kept groups
    # with equal rewards (the filter off), which train with no advantage
    tokens: dict[str, int]
    rollouts: int
    failed_rollouts: int


class ProgressWatch:
    """Counts what the current step's wait produced and applies the stop rules. One per trainer
    process, owned by the leader; `clock` is injectable for tests."""

    def __init__(
        self,
        settings: ProgressConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._wall_clock = wall_clock
        self._log = ProgressLog(settings.log) if settings.log is not None else None
        self._step_durations: list[float] = []
        self._last_step_at = clock()
        # (when seen, failure reason or None) of the last infra_window rollouts
        self._rollouts: deque[tuple[float, str | None]] = deque(maxlen=settings.infra_window)
        self._failing_since: float | None = None  # since when the window has been failing
        self._reset_step()

    def _reset_step(self) -> None:
        self._rejected: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()  # generated response tokens, by verdict
        self._no_signal: Counter[str] = Counter()
        self._step_rollouts = 0
        self._step_failed = 0
        self._step_failures: Counter[str] = Counter()
        self._reported_at = self._clock()

    # -- what happened ----------------------------------------------------------------------

    def observe(self, group: GroupWithTrajectories, verdict: str) -> None:
        """One judged group: its verdict and its rollouts' failures."""
        from relayrl.trainer.batch import is_valid

        valid = [t.reward.score for t in group.trajectories if is_valid(t)]
        # A group kept with the filter off whose rewards are all equal trains with no advantage:
        # its tokens count as without signal too, as they would with the filter on.
        bucket = "no_signal" if verdict == "keep" and len(set(valid)) < 2 else verdict
        self._tokens[bucket] += sum(
            len(part.response_token_ids) for t in group.trajectories for part in (t, *t.segments)
        )
        if verdict != "keep":
            self._rejected[verdict] += 1
        if verdict == "no_signal":
            self._no_signal[no_signal_reason(valid)] += 1
        now = self._clock()
        for trajectory in group.trajectories:
            reason = failure_reason(trajectory)
            self._step_rollouts += 1
            self._rollouts.append((now, reason))
            if reason is not None:
                self._step_failed += 1
                self._step_failures[reason] += 1

    def step_tally(self, top: int = 5) -> StepTally:
        """What this step consumed (its `top` failure reasons)."""
        return StepTally(
            no_signal=dict(self._no_signal),
            failures=dict(self._step_failures.most_common(top)),
            tokens=dict(self._tokens),
            rollouts=self._step_rollouts,
            failed_rollouts=self._step_failed,
        )

    def step_completed(self) -> None:
        now = self._clock()
        self._step_durations.append(now - self._last_step_at)
        self._last_step_at = now
        self._reset_step()

    # -- while waiting ----------------------------------------------------------------------

    def record(self, step: int, wanted: int, kept: int, consumed: int) -> ProgressRecord:
        """What the current step has so far."""
        top, top_count = (self._step_failures.most_common(1) or [("", 0)])[0]
        return ProgressRecord(
            kind="waiting",
            step=step,
            waited_s=round(self._clock() - self._last_step_at, 1),
            wanted=wanted,
            kept=kept,
            consumed=consumed,
            rejected=dict(self._rejected),
            no_signal=dict(self._no_signal),
            rollouts=self._step_rollouts,
            failed_rollouts=self._step_failed,
            top_failure=top,
            top_failure_count=top_count,
            time=self._wall_clock(),
        )

    def waiting(self, step: int, wanted: int, kept: int, consumed: int) -> None:
        """Called before every sleep of a waiting step: reports every report_interval_s, and
        raises NoProgress when a stop rule fires (after writing the `stopped` record)."""
        cause = self._infra_cause() or self._stall_cause(step, wanted, kept, consumed)
        if cause is not None:
            record = self.record(step, wanted, kept, consumed)
            record.kind, record.cause = "stopped", cause
            self._emit(record, logging.ERROR)
            raise NoProgress(cause)
        if self._clock() - self._reported_at >= self.settings.report_interval_s:
            self._reported_at = self._clock()
            self._emit(self.record(step, wanted, kept, consumed), logging.INFO)

    def stop(self, step: int, cause: str) -> NoReturn:
        """Ends the run for `cause`, a rule outside the watch's own (a prompt that ran out of
        re-issues under `data.retry.on_exhausted: stop`): the same `stopped` record, error
        line and NoProgress as a stop rule."""
        record = self.record(step, 0, 0, 0)
        record.kind, record.cause = "stopped", cause
        self._emit(record, logging.ERROR)
        raise NoProgress(cause)

    def stall_limit_s(self) -> float:
        s = self.settings
        if not self._step_durations:
            return s.stall_min_s
        return max(s.stall_min_s, s.stall_step_factor * statistics.median(self._step_durations))

    def _stall_cause(self, step: int, wanted: int, kept: int, consumed: int) -> str | None:
        waited = self._clock() - self._last_step_at
        limit = self.stall_limit_s()
        if waited < limit:
            return None
        record = self.record(step, wanted, kept, consumed)
        return (
            f"no step completed in {_duration(waited)} (the limit is {_duration(limit)}): "
            f"step {step} has {kept} of {wanted} groups; {diagnosis(record)}"
        )

    def _infra_cause(self) -> str | None:
        s, window = self.settings, self._rollouts
        reasons = Counter(reason for _, reason in window if reason is not None)
        failed = sum(reasons.values())
        if len(window) < s.infra_window or failed < s.infra_fraction * len(window):
            self._failing_since = None
            return None
        if self._failing_since is None:
            self._failing_since = self._clock()
        if self._clock() - self._failing_since < s.infra_grace_s:
            return None
        reason, count = reasons.most_common(1)[0]
        return (
            f"{failed} of the last {len(window)} rollouts failed as infrastructure "
            f"(the limit is {s.infra_fraction:.0%}); most common, {count}x: {reason}"
        )

    def _emit(self, record: ProgressRecord, level: int) -> None:
        logger.log(level, "%s", record.line())
        if self._log is not None:
            self._log.append(record)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def diagnosis(record: ProgressRecord) -> str:
    """What a stalled step's counts point at, in words."""
    rejected = sum(record.rejected.values())
    if not record.consumed:
        return (
            "no scored group arrived: is rollout (the gateway, its engines or agents) or the "
            "reward-service running?"
        )
    if record.failed_rollouts and record.failed_rollouts >= record.rollouts / 2:
        return record.failures_text()
    no_signal = record.rejected.get("no_signal", 0)
    if no_signal and no_signal >= rejected / 2:
        return (
            f"the filter rejected {no_signal} of {record.consumed} groups as without signal "
            f"({', '.join(f'{w} {n}' for w, n in record.no_signal.items())}): the task is too "
            "hard or too easy for the model at this temperature, or the reward cannot read "
            "its answers"
        )
    return f"rejected {record.rejected_text()}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
