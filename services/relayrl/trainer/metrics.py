"""The trainer's per-step metrics: Prometheus series and a JSONL log.

Every step produces one flat dict of scalars (`StepMetrics.values`) plus histograms (staleness
of the trained groups, lengths of trained vs launched trajectories). The same values go to
the JSONL log (one `relayrl.core.records.StepRecord` per step) and to Prometheus, so a
dashboard and an offline analysis never disagree.
Scalar gauges carry one bounded label, `metric`, naming an entry of `GAUGE_METRICS`.
"""

from __future__ import annotations

import math
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relayrl.core.metrics import metric_name
from relayrl.core.records import RecordWriter, StepRecord

SERVICE = "trainer"
STALENESS_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)
LENGTH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# The per-step scalars exported as relayrl_trainer_step_value{metric=...}; anything else in a
# step's record goes only to the JSONL log (keeps the label set bounded and documented).
GAUGE_METRICS = (
    "reward_mean",
    "reward_std",
    "loss",
    "grad_norm",
    "lr",
    "kl",
    "k3_kl",
    "ppl_ratio",
    "log_ppl_diff",
    "chi2_token",
    "chi2_seq",
    "is_ess",
    "is_frac_capped",
    "is_raw_frac_over_cap",
    "abs_log_ratio_mean",
    "abs_log_ratio_p99",
    "abs_log_ratio_max",
    "rs_rejected_token_frac",
    "pg_clipfrac",
    "pg_approx_kl",
    "ref_kl",
    "staleness_mean",
    "staleness_max",
    "policy_lag_mean",
    "policy_lag_max",
    "tokens_per_s",
    "step_duration_s",
    "wait_duration_s",
    "trained_response_len_mean",
    "launched_response_len_mean",
)


def _name(quantity: str, unit: str) -> str:
    return metric_name(SERVICE, quantity, unit)


@dataclass
class StepMetrics:
    step: int
    values: dict[str, float] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)  # one entry per trained group
    policy_lag: list[int] = field(default_factory=list)  # step - launching version, per group
    trained_lengths: list[int] = field(default_factory=list)  # response tokens per row
    row_tokens: list[int] = field(default_factory=list)  # prompt + response per row, in order
    launched_lengths: list[int] = field(default_factory=list)  # every consumed trajectory
    groups: dict[str, int] = field(default_factory=dict)  # kept / stale / no_signal / ...
    no_signal: dict[str, int] = field(default_factory=dict)  # why groups had no signal
    failures: dict[str, int] = field(default_factory=dict)  # infra failure reason -> rollouts
    generated_tokens: dict[str, int] = field(default_factory=dict)  # verdict -> tokens
    set_aside: list[dict[str, object]] = field(default_factory=list)  # the curriculum's
    retried: dict[str, int] = field(default_factory=dict)  # groups re-issued, by cause
    skipped: list[dict[str, object]] = field(default_factory=list)  # issues out of retries
    uids: list[str] = field(default_factory=list)  # the groups trained at this step

    def record(self, phases_s: dict[str, float], at: float) -> StepRecord:
        """The step's log record (a scalar that is not finite is left out), logged at `at`."""
        return StepRecord.model_validate(
            {
                **{k: v for k, v in self.values.items() if math.isfinite(v)},
                "step": self.step,
                "time": at,
                "phases_s": phases_s,
                "staleness_histogram": dict(sorted(Tally(self.staleness).items())),
                "policy_lag_histogram": dict(sorted(Tally(self.policy_lag).items())),
                "groups": self.groups,
                "no_signal": self.no_signal,
                "failures": self.failures,
                "generated_tokens": self.generated_tokens,
                "set_aside": self.set_aside,
                "retried": self.retried,
                "skipped": self.skipped,
                "uids": self.uids,
                "row_tokens": self.row_tokens,
            }
        )


class TrainerMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        log_path: Path | None = None,
        staleness_bound_steps: int | None = None,
    ) -> None:
        self.step = Gauge(_name("completed", "steps"), "Steps completed.", registry=registry)
        self.staleness_bound = Gauge(
            _name("staleness_bound", "steps"),
            "Configured staleness bound (algorithm.staleness.threshold: the replay gate's "
            "threshold, by default the mode's bound, eta + parameter_sync_step when async).",
            registry=registry,
        )
        if staleness_bound_steps is not None:
            self.staleness_bound.set(staleness_bound_steps)
        self.published_version = Gauge(
            _name("published_policy", "version"),
            "Policy version last published to rollout.",
            registry=registry,
        )
        self.value = Gauge(
            _name("step", "value"),
            "Per-step scalars of the last step (see relayrl.trainer.metrics.GAUGE_METRICS).",
            ["metric"],
            registry=registry,
        )
        self.staleness = Histogram(
            _name("trained_staleness", "steps"),
            "Staleness (step - prompt_step + 1) of every trained group.",
            registry=registry,
            buckets=STALENESS_BUCKETS,
        )
        self.trained_length = Histogram(
            _name("trained_response_length", "tokens"),
            "Response length of trained trajectories.",
            registry=registry,
            buckets=LENGTH_BUCKETS,
        )
        self.launched_length = Histogram(
            _name("launched_response_length", "tokens"),
            "Response length of every consumed trajectory (trained or not).",
            registry=registry,
            buckets=LENGTH_BUCKETS,
        )
        self.groups = Counter(
            _name("groups", "total"),
            "Consumed or evicted groups by verdict (keep, stale, no_signal, no_valid, "
            "one_valid, evicted).",
            ["verdict"],
            registry=registry,
        )
        self.retried = Counter(
            _name("retried_groups", "total"),
            "Groups whose prompt was re-issued, by cause (no_valid, one_valid, stale): they "
            "could not be trained for a reason outside the policy.",
            ["cause"],
            registry=registry,
        )
        self.skipped = Counter(
            _name("skipped_prompts", "total"),
            "Issues of a prompt given up after their retry budget (data.retry), by cause.",
            ["cause"],
            registry=registry,
        )
        self.trained_tokens = Counter(
            _name("trained_tokens", "total"),
            "Trained tokens: prompt and response of every trained row.",
            registry=registry,
        )
        self.phase_duration = Gauge(
            _name("phase_duration", "seconds"),
            "Duration of each phase of the last step (wait, old_logprobs, update, publish...).",
            ["phase"],
            registry=registry,
        )
        self._log = RecordWriter(log_path) if log_path is not None else None

    def observe(self, metrics: StepMetrics, phases_s: dict[str, float]) -> None:
        self.step.set(metrics.step)
        for name in GAUGE_METRICS:
            value = metrics.values.get(name)
            if value is not None and math.isfinite(value):
                self.value.labels(name).set(value)
        for s in metrics.staleness:
            self.staleness.observe(s)
        for n in metrics.trained_lengths:
            self.trained_length.observe(n)
        for n in metrics.launched_lengths:
            self.launched_length.observe(n)
        for verdict, n in metrics.groups.items():
            self.groups.labels(verdict).inc(n)
        for cause, n in metrics.retried.items():
            self.retried.labels(cause).inc(n)
        for skipped in metrics.skipped:
            self.skipped.labels(str(skipped["cause"])).inc()
        self.trained_tokens.inc(metrics.values.get("trained_tokens", 0))
        for phase, seconds in phases_s.items():
            self.phase_duration.labels(phase).set(seconds)
        if self._log is not None:
            self._log.write(metrics.record(phases_s, time.time()))

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
