"""A discrete-event simulator of a rollout pipeline (docs/simulation.md#model): `n_slots`
generation slots, one trainer that consumes `batch_size` finished rollouts per step, and a
weight sync that pauses all generation.

Time jumps from event to event (a rollout ends, a train step ends, a sync ends). Each round of
the outer loop

1. fills idle slots while the throttle allows: a rollout may launch only while
   live < (v + 1 + eta) * batch_size, v being the published (engine) version and `live` the
   rollouts launched so far less those discarded (see below); never while a sync runs, nor
   (drain mode) while a requested sync waits for the in-flight rollouts to finish;
2. starts a train step when the trainer is idle and batch_size rollouts are buffered: the
   earliest-finished ones, each with staleness = completed train steps - launching version;
3. advances time to the earliest pending event and processes it: a sync end publishes the
   next version, a train end requests a sync, a rollout end buffers the rollout. Partial
   (interruptible) mode starts a requested sync at once and pushes every in-flight rollout's
   end back by sync_time_s; drain mode starts it only when nothing is in flight.

Beyond the seed: consumer-side dropping of rollouts staler than eta, a rollout timeout,
constant-hazard worker failures, and `train_during_sync=False` (the trainer waits for its
sync to commit before its next step, as the real relayrl trainer does). A discarded rollout
(stale, timed out or failed and dropped) gives its place in the throttle back: the seed never
discards, and without that a sync pipeline that loses one rollout would wait forever for a
batch that cannot fill.

The run stops when the `steps`-th train step ends: the makespan is that instant, so the sync
that would follow the last step is not counted (it serves a step that is never run), and
rollouts per hour = trained rollouts / makespan. Slot utilisation counts an interrupted
rollout's paused time as busy, as the seed does (it slightly overestimates).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real
from typing import Any, Literal

import numpy as np

DESIGNS = ("sync", "one_step_drain", "partial")
"""sync: eta = 0. one_step_drain: eta = 1, syncs drain. partial: interruptible, any eta."""
TIMEOUT_POLICIES = ("truncate", "drop")
FAILURE_POLICIES = ("drop", "retry")
MAX_ATTEMPTS = 1000
"""Attempts of one rollout under failure_policy="retry" before the simulation gives up."""

# What ended an attempt.
FINISHED, TRUNCATED, TIMED_OUT, FAILED, RUNNING = (
    "finished",
    "truncated",
    "timed_out",
    "failed",
    "running",
)
# Event kinds, in the order simultaneous events are processed.
_ROLLOUT_END, _SYNC_END, _TRAIN_END = 0, 1, 2
_FAILURE_SALT = 0xFA11


class DurationsExhausted(ValueError):
    """The simulation launched every duration it was given and needs more."""

    def __init__(self, given: int, needed: int, steps_done: int, steps: int) -> None:
        self.given, self.needed, self.steps_done = given, needed, steps_done
        super().__init__(
            f"the simulation used all {given} durations with {steps_done} of {steps} train "
            f"steps done; give more (about {needed})"
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_seconds(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline design and its costs (docs/simulation.md#designs)."""

    n_slots: int = 64
    """Generation slots: rollouts the engines run concurrently."""
    batch_size: int = 64
    """Finished rollouts the trainer consumes per step."""
    train_time_s: float = 60.0
    """Seconds one train step takes."""
    sync_time_s: float = 10.0
    """Seconds one weight sync takes; it pauses all generation."""
    steps: int = 20
    """Train steps to simulate; the run ends when the last one ends."""
    eta: int = 1
    """Staleness bound of the throttle: launched < (v + 1 + eta) * batch_size. 0 is sync."""
    drain: bool = False
    """Syncs wait for the in-flight rollouts to finish (no launches meanwhile) instead of
    interrupting them."""
    drop_stale: bool = False
    """The trainer discards buffered rollouts whose staleness exceeds eta at step start."""
    timeout_s: float | None = None
    """Running seconds after which a rollout is cut (None: never)."""
    timeout_policy: Literal["truncate", "drop"] = "truncate"
    """truncate: a cut rollout finishes at the timeout and is trained; drop: it is discarded."""
    failure_hazard_per_s: float = 0.0
    """Constant hazard of a worker failure per second of running time."""
    failure_policy: Literal["drop", "retry"] = "drop"
    """drop: a failed rollout is discarded; retry: it restarts from scratch on its slot, with
    the same duration, under the then-published version (at once, even while a drain waits:
    the rollout is still owed; it is not a new launch for the throttle)."""
    train_during_sync: bool = True
    """The trainer may start its next step while a sync is pending or running (the seed's
    simulator); False: it waits for the sync to end (relayrl's trainer waits for the commit)."""
    failure_seed: int = 0
    """Seed of the failure times (the same seed gives every design the same failures)."""

    def __post_init__(self) -> None:
        _check_int("n_slots", self.n_slots, 1)
        _check_int("batch_size", self.batch_size, 1)
        _check_seconds("train_time_s", self.train_time_s, positive=True)
        _check_seconds("sync_time_s", self.sync_time_s, positive=False)
        _check_int("steps", self.steps, 1)
        _check_int("eta", self.eta, 0)
        if self.timeout_s is not None:
            _check_seconds("timeout_s", self.timeout_s, positive=True)
        if self.timeout_policy not in TIMEOUT_POLICIES:
            raise ValueError(
                f"timeout_policy must be one of {TIMEOUT_POLICIES}, got {self.timeout_policy!r}"
            )
        hazard = self.failure_hazard_per_s
        if isinstance(hazard, bool) or not isinstance(hazard, Real) or not math.isfinite(hazard):
            raise ValueError(f"failure_hazard_per_s must be a finite number, got {hazard!r}")
        if hazard < 0:
            raise ValueError(f"failure_hazard_per_s must be >= 0, got {hazard}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}"
            )
        _check_int("failure_seed", self.failure_seed, 0)

    @classmethod
    def for_design(cls, design: str, **given: Any) -> PipelineConfig:
        """A config of one of DESIGNS; `given` sets the other fields (and eta for partial,
        default 1). Setting a field the design fixes to another value is a ValueError."""
        fixed: dict[str, dict[str, Any]] = {
            "sync": {"eta": 0},
            "one_step_drain": {"eta": 1, "drain": True},
            "partial": {},
        }
        if design not in fixed:
            raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
        for name, value in fixed[design].items():
            if name in given and given[name] != value:
                raise ValueError(f"design {design!r} fixes {name}={value}; got {given[name]!r}")
        return cls(**{**given, **fixed[design]})

    @property
    def design(self) -> str:
        """The design this config is: sync, one_step_drain or partial (drain: partial+drain)."""
        if self.eta == 0:
            return "sync"
        if self.drain:
            return "one_step_drain" if self.eta == 1 else "partial+drain"
        return "partial"

    @property
    def discards(self) -> bool:
        """Whether rollouts can be discarded (so more durations than the throttle bound)."""
        return (
            self.drop_stale
            or (self.timeout_s is not None and self.timeout_policy == "drop")
            or (self.failure_hazard_per_s > 0 and self.failure_policy == "drop")
        )

    def durations_needed(self) -> int:
        """Durations a run launches at most when nothing is discarded: before the last step
        ends v <= steps - 1, so launched < (steps + eta) * batch_size."""
        return (self.steps + self.eta) * self.batch_size

    def describe(self) -> str:
        parts = [
            f"{self.design} (eta={self.eta})",
            f"{self.n_slots} slots",
            f"{self.batch_size} rollouts/step",
            f"train {self.train_time_s:g} s",
            f"sync {self.sync_time_s:g} s",
            f"{self.steps} steps",
        ]
        if self.drop_stale:
            parts.append("drop-stale")
        if self.timeout_s is not None:
            parts.append(f"timeout {self.timeout_s:g} s ({self.timeout_policy})")
        if self.failure_hazard_per_s > 0:
            parts.append(f"failures {self.failure_hazard_per_s:g}/s ({self.failure_policy})")
        if not self.train_during_sync:
            parts.append("trainer waits for syncs")
        return ", ".join(parts)


@dataclass(frozen=True)
class RolloutSpan:
    """One attempt of one rollout on one slot."""

    rollout: int  # launch index = index into the durations
    attempt: int  # 0, then 1, 2, ... for retries
    slot: int
    version: int  # the published version it was launched under
    start_s: float
    end_s: float  # pauses included; clipped to the makespan when still running
    duration_s: float  # the rollout's own duration (running time if never cut)
    ended: str  # FINISHED, TRUNCATED, TIMED_OUT, FAILED or RUNNING
    trained_step: int | None  # the train step that consumed it
    dropped_stale: bool


@dataclass(frozen=True)
class TrainSpan:
    step: int  # = the trainer's version at its start
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SyncSpan:
    version: int  # the version it publishes
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """Everything that happened, for plots and checks."""

    n_slots: int
    makespan_s: float
    rollouts: tuple[RolloutSpan, ...]
    train_steps: tuple[TrainSpan, ...]
    syncs: tuple[SyncSpan, ...]


@dataclass(frozen=True)
class SimResult:
    config: PipelineConfig
    makespan_s: float
    """When the last train step ended (the sync after it is not counted)."""
    rollouts_per_hour: float
    """Trained rollouts / makespan * 3600."""
    utilisation: float
    """Busy slot time / (n_slots * makespan); an interrupted rollout's pause counts as busy."""
    staleness_mean: float
    staleness_max: int
    staleness_histogram: dict[int, int]
    """Trained rollouts by staleness (trainer version at step start - launching version)."""
    trained_duration_mean_s: float
    """Mean running time of the trained rollouts (a truncated one counts its timeout)."""
    launched_duration_mean_s: float
    """Mean duration of every launched rollout (its own duration, cut or not)."""
    num_trained: int
    num_launched: int
    num_dropped: int
    """Launched rollouts discarded untrained: stale + timed out + failed (drop policy)."""
    num_dropped_stale: int
    num_dropped_timeout: int
    num_truncated: int
    """Rollouts cut at the timeout and kept (truncate policy), trained or not yet."""
    num_failed: int
    """Failed attempts (under retry, each failure of a rollout counts)."""
    num_retries: int
    failed_busy_s: float
    """Slot seconds spent on attempts that failed (the retry cost under failure_policy=retry)."""
    busy_s: float
    num_in_flight_at_end: int
    timeline: Timeline

    @property
    def retry_cost(self) -> float:
        """Share of busy slot time spent on attempts that failed."""
        return self.failed_busy_s / self.busy_s if self.busy_s else 0.0

    def to_json(self, timeline: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"config": asdict(self.config), "design": self.config.design}
        for f in fields(self):
            if f.name in ("config", "timeline"):
                continue
            out[f.name] = getattr(self, f.name)
        out["staleness_histogram"] = {str(k): v for k, v in self.staleness_histogram.items()}
        out["retry_cost"] = self.retry_cost
        if timeline:
            out["timeline"] = asdict(self.timeline)
        return out


def simulate(config: PipelineConfig, durations: np.ndarray) -> SimResult:
    """Run `config` on rollouts whose durations (seconds) are `durations`, in launch order.
    DurationsExhausted (a ValueError) if it needs more than given."""
    array = np.asarray(durations, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"durations must be 1-D, got shape {array.shape}")
    if array.size and (not np.all(np.isfinite(array)) or array.min() < 0):
        raise ValueError("durations must be finite and >= 0 seconds")
    return _Simulation(config, array).run()


class _Simulation:
    """The state of one run; `run` is the outer loop of the module docstring."""

    def __init__(self, config: PipelineConfig, durations: np.ndarray) -> None:
        self.c = config
        self.durations: list[float] = durations.tolist()
        hazard = config.failure_hazard_per_s
        if hazard > 0:
            # First attempts: one draw per launch index, so designs share their failures. The
            # salt keeps these streams apart from EpisodeModel's default_rng([seed, block]):
            # sharing its bits would correlate failures with durations.
            self.first_failure: list[float] = (
                np.random.default_rng([_FAILURE_SALT, config.failure_seed, 0])
                .exponential(1.0 / hazard, len(self.durations))
                .tolist()
            )
            self.retry_rng = np.random.default_rng([_FAILURE_SALT, config.failure_seed, 1])
        else:
            self.first_failure = [math.inf] * len(self.durations)
        self.t = 0.0
        self.version = 0  # published
        self.steps_done = 0  # the trainer's version
        self.free_slots = list(range(config.n_slots))  # a heap: the lowest free slot first
        self.inflight: list[tuple[float, int]] = []  # (end, attempt), a heap
        self.finished: list[tuple[float, int]] = []  # (finish time, rollout), a heap
        self.train_end: float | None = None
        self.sync_end: float | None = None
        self.syncs_waiting = 0
        self.num_launched = 0
        self.num_given_back = 0
        self.num_dropped_stale = self.num_dropped_timeout = self.num_dropped_failed = 0
        self.num_failed = self.num_retries = 0
        # per attempt
        self.a_rollout: list[int] = []
        self.a_attempt: list[int] = []
        self.a_slot: list[int] = []
        self.a_version: list[int] = []
        self.a_start: list[float] = []
        self.a_end: list[float] = []
        self.a_run: list[float] = []
        self.a_ended: list[str] = []
        # per rollout
        self.r_attempts: list[int] = []
        self.r_last_attempt: list[int] = []
        self.r_trained_step: dict[int, int] = {}
        self.r_dropped_stale: set[int] = set()
        self.staleness: list[int] = []
        self.trained_run_s: list[float] = []
        self.train_spans: list[TrainSpan] = []
        self.sync_starts: list[float] = []
        self.sync_spans: list[SyncSpan] = []

    # -- the outer loop ------------------------------------------------------------------
    def run(self) -> SimResult:
        while True:
            self._fill()
            if self._try_train():
                self._fill()  # discarded stale rollouts gave their throttle places back
            kind = self._advance()
            if kind == _ROLLOUT_END:
                self._on_rollout_end()
            elif kind == _SYNC_END:
                self._on_sync_end()
            elif self._on_train_end():
                return self._result()

    def _may_launch(self) -> bool:
        if self.sync_end is not None or (self.c.drain and self.syncs_waiting):
            return False
        live = self.num_launched - self.num_given_back
        return live < (self.version + 1 + self.c.eta) * self.c.batch_size

    def _fill(self) -> None:
        while self.free_slots and self._may_launch():
            rollout = self.num_launched
            if rollout >= len(self.durations):
                raise self._exhausted()
            self.num_launched += 1
            self.r_attempts.append(0)
            self.r_last_attempt.append(-1)
            slot = heapq.heappop(self.free_slots)
            self._launch(rollout, slot, self.first_failure[rollout])

    def _launch(self, rollout: int, slot: int, fails_after_s: float) -> None:
        duration = self.durations[rollout]
        cut = duration if self.c.timeout_s is None else min(duration, self.c.timeout_s)
        if fails_after_s < cut:
            run_s, ended = fails_after_s, FAILED
        elif cut < duration:
            run_s, ended = cut, (TRUNCATED if self.c.timeout_policy == "truncate" else TIMED_OUT)
        else:
            run_s, ended = duration, FINISHED
        attempt = len(self.a_start)
        self.a_rollout.append(rollout)
        self.a_attempt.append(self.r_attempts[rollout])
        self.a_slot.append(slot)
        self.a_version.append(self.version)
        self.a_start.append(self.t)
        self.a_end.append(self.t + run_s)
        self.a_run.append(run_s)
        self.a_ended.append(ended)
        self.r_last_attempt[rollout] = attempt
        heapq.heappush(self.inflight, (self.t + run_s, attempt))

    def _try_train(self) -> bool:
        """Start a step if the trainer can; True if it discarded stale rollouts."""
        c = self.c
        if self.train_end is not None or len(self.finished) < c.batch_size:
            return False
        if not c.train_during_sync and (self.sync_end is not None or self.syncs_waiting):
            return False
        batch: list[int] = []
        discarded = False
        while len(batch) < c.batch_size and self.finished:
            _, rollout = heapq.heappop(self.finished)
            if c.drop_stale and self._staleness(rollout) > c.eta:
                # Staleness only grows: a rollout too stale now can never be trained.
                self.r_dropped_stale.add(rollout)
                self.num_dropped_stale += 1
                self.num_given_back += 1
                discarded = True
                continue
            batch.append(rollout)
        if len(batch) < c.batch_size:
            for rollout in batch:
                attempt = self.r_last_attempt[rollout]
                heapq.heappush(self.finished, (self.a_end[attempt], rollout))
            return discarded
        for rollout in batch:
            self.staleness.append(self._staleness(rollout))
            self.trained_run_s.append(self.a_run[self.r_last_attempt[rollout]])
            self.r_trained_step[rollout] = self.steps_done
        self.train_end = self.t + c.train_time_s
        self.train_spans.append(TrainSpan(self.steps_done, self.t, self.train_end))
        return discarded

    def _staleness(self, rollout: int) -> int:
        return self.steps_done - self.a_version[self.r_last_attempt[rollout]]

    def _advance(self) -> int:
        """Move time to the earliest pending event; its kind (ties: rollouts, syncs, train)."""
        best: tuple[float, int] | None = None
        if self.inflight:
            best = (self.inflight[0][0], _ROLLOUT_END)
        if self.sync_end is not None and (best is None or self.sync_end < best[0]):
            best = (self.sync_end, _SYNC_END)
        if self.train_end is not None and (best is None or self.train_end < best[0]):
            best = (self.train_end, _TRAIN_END)
        assert best is not None, "no pending event: the pipeline is stuck (a simulator bug)"
        self.t = best[0]
        return best[1]

    # -- events ----------------------------------------------------------------------------
    def _on_rollout_end(self) -> None:
        _, attempt = heapq.heappop(self.inflight)
        rollout, slot, ended = self.a_rollout[attempt], self.a_slot[attempt], self.a_ended[attempt]
        if ended in (FINISHED, TRUNCATED):
            heapq.heappush(self.finished, (self.t, rollout))
        elif ended == TIMED_OUT:
            self.num_dropped_timeout += 1
            self.num_given_back += 1
        else:  # FAILED
            self.num_failed += 1
            if self.c.failure_policy == "retry":
                self._retry(rollout, slot)
                return
            self.num_dropped_failed += 1
            self.num_given_back += 1
        heapq.heappush(self.free_slots, slot)
        self._maybe_start_sync()

    def _retry(self, rollout: int, slot: int) -> None:
        self.r_attempts[rollout] += 1
        if self.r_attempts[rollout] >= MAX_ATTEMPTS:
            raise ValueError(
                f"rollout {rollout} ({self.durations[rollout]:.0f} s) failed {MAX_ATTEMPTS} "
                f"times in a row: failure_hazard_per_s={self.c.failure_hazard_per_s} is too high "
                "for failure_policy='retry'"
            )
        self.num_retries += 1
        self._launch(
            rollout, slot, float(self.retry_rng.exponential(1.0 / self.c.failure_hazard_per_s))
        )

    def _on_train_end(self) -> bool:
        """True when it was the last step."""
        self.train_end = None
        self.steps_done += 1
        if self.steps_done == self.c.steps:
            return True
        self.syncs_waiting += 1
        self._maybe_start_sync()
        return False

    def _maybe_start_sync(self) -> None:
        if self.sync_end is not None or not self.syncs_waiting:
            return
        if self.c.drain and self.inflight:
            return
        self.syncs_waiting -= 1
        self.sync_end = self.t + self.c.sync_time_s
        self.sync_starts.append(self.t)
        if self.inflight:  # interruptible: every in-flight rollout waits out the sync
            pause = self.c.sync_time_s
            # A uniform shift keeps the heap ordered.
            self.inflight = [(end + pause, attempt) for end, attempt in self.inflight]
            for _, attempt in self.inflight:
                self.a_end[attempt] += pause

    def _on_sync_end(self) -> None:
        assert self.sync_end is not None
        self.version += 1
        self.sync_spans.append(SyncSpan(self.version, self.sync_starts[-1], self.sync_end))
        self.sync_end = None
        self._maybe_start_sync()

    # -- the result ------------------------------------------------------------------------
    def _exhausted(self) -> DurationsExhausted:
        given = len(self.durations)
        needed = max(self.c.durations_needed(), given + self.c.n_slots)
        if self.steps_done:
            needed = max(needed, math.ceil(given * (self.c.steps + 1) / self.steps_done))
        else:
            needed = max(needed, 2 * given)
        return DurationsExhausted(given, needed, self.steps_done, self.c.steps)

    def _spans(self, makespan: float) -> tuple[RolloutSpan, ...]:
        running = {attempt for _, attempt in self.inflight}
        spans = []
        for a in range(len(self.a_start)):
            rollout = self.a_rollout[a]
            last = self.r_last_attempt[rollout] == a
            spans.append(
                RolloutSpan(
                    rollout=rollout,
                    attempt=self.a_attempt[a],
                    slot=self.a_slot[a],
                    version=self.a_version[a],
                    start_s=self.a_start[a],
                    end_s=min(self.a_end[a], makespan),
                    duration_s=self.durations[rollout],
                    ended=RUNNING if a in running else self.a_ended[a],
                    trained_step=self.r_trained_step.get(rollout) if last else None,
                    dropped_stale=last and rollout in self.r_dropped_stale,
                )
            )
        return tuple(spans)

    def _result(self) -> SimResult:
        c, makespan = self.c, self.t
        start = np.asarray(self.a_start)
        busy = np.minimum(np.asarray(self.a_end), makespan) - start
        failed = np.asarray(self.a_ended) == FAILED
        running = {attempt for _, attempt in self.inflight}
        failed[list(running)] = False  # a failure scheduled after the end has not happened
        staleness = np.asarray(self.staleness)
        histogram = Counter(self.staleness)
        busy_s = float(busy.sum())
        spans = self._spans(makespan)
        return SimResult(
            config=c,
            makespan_s=makespan,
            rollouts_per_hour=len(self.staleness) / makespan * 3600.0,
            utilisation=busy_s / (c.n_slots * makespan),
            staleness_mean=float(staleness.mean()),
            staleness_max=int(staleness.max()),
            staleness_histogram={k: histogram[k] for k in sorted(histogram)},
            trained_duration_mean_s=float(np.mean(self.trained_run_s)),
            launched_duration_mean_s=float(np.mean(self.durations[: self.num_launched])),
            num_trained=len(self.staleness),
            num_launched=self.num_launched,
            num_dropped=self.num_dropped_stale + self.num_dropped_timeout + self.num_dropped_failed,
            num_dropped_stale=self.num_dropped_stale,
            num_dropped_timeout=self.num_dropped_timeout,
            num_truncated=sum(1 for s in spans if s.ended == TRUNCATED),
            num_failed=self.num_failed,
            num_retries=self.num_retries,
            failed_busy_s=float(busy[failed].sum()),
            busy_s=busy_s,
            num_in_flight_at_end=len(self.inflight),
            timeline=Timeline(
                n_slots=c.n_slots,
                makespan_s=makespan,
                rollouts=spans,
                train_steps=tuple(self.train_spans),
                syncs=tuple(self.sync_spans),
            ),
        )
