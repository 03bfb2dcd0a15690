"""The training loop: one step after another, on every rank, with rank 0 as the leader.

Rank 0 owns everything outside the model: the TransferQueue (feeding prompts, the staleness
gate, consumption), the gateway link, metrics and the control state the gRPC service changes.
It broadcasts each step's batch (or a stop) to the other ranks; then every rank runs the same
update, publish and checkpoint, which are collective.

Exactly-once across crashes rests on three facts: the TransferQueue marks the groups a step
takes as consumed at that step (idempotently: a restarted step gets the same groups back), a
checkpoint records the next step together with the model, optimizer and RNG, and on resume the
groups consumed after the checkpoint go back to scored. A trainer killed at any point therefore
neither loses a group nor trains one twice.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
import torch.distributed as dist

from relayrl.core.outage import Outage
from relayrl.proto.common.v1 import common_pb2
from relayrl.tq import TransferQueue
from relayrl.tq.model import GroupWithTrajectories
from relayrl.tq.queue import TQUnavailableError
from relayrl.trainer.batch import ScoredGroup, is_valid, scored_groups
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.curriculum import RETRY_CAUSES, RetryCause
from relayrl.trainer.feeder import PromptFeeder
from relayrl.trainer.metrics import StepMetrics, TrainerMetrics
from relayrl.trainer.modes import TrainerMode
from relayrl.trainer.progress import ProgressWatch, group_failure_text
from relayrl.trainer.publish import WeightPublisher
from relayrl.trainer.replay import (
    ReplaySampler,
    Sample,
    SamplingStopped,
    Verdict,
    judge_group,
)
from relayrl.trainer.rollout_link import GatewayLink
from relayrl.trainer.runtime import Policy
from relayrl.trainer.step import DataParallel, StepResult, Updater

logger = logging.getLogger(__name__)

ANNOUNCE_INTERVAL_S = 5.0
"""How often a waiting leader repeats UpdatePolicyStep to the gateway."""


class State(enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    WAITING = "waiting"
    PAUSED = "paused"
    CHECKPOINTING = "checkpointing"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class Control:
    """What the gRPC service (another thread) asks of the loop; read by the leader between
    steps."""

    paused: bool = False
    stop: bool = False
    checkpoint_now: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)


@dataclass
class Status:
    state: State = State.STARTING
    step: int = 0
    published_version: int = 0
    last_checkpoint_step: int = -1
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


class Leader:
    """Rank 0's side of a step: feed, gate, consume; then metrics and the gateway.
    Built by `TrainerConfig.build_leader`, which builds its feeder, sampler and gateway link."""

    def __init__(
        self,
        config: TrainerConfig,
        tq: TransferQueue,
        mode: TrainerMode,
        *,
        feeder: PromptFeeder | None,
        sampler: ReplaySampler,
        watch: ProgressWatch,
        gateway: GatewayLink | None,
    ) -> None:
        self.config = config
        self.tq = tq
        self.mode = mode
        self.partition = config.data.partition
        self.feeder = feeder
        self.sampler = sampler
        self.watch = watch
        self.refill_groups = 0
        self.gateway = gateway
        self._announced_at = 0.0

    def _through_outage(self, what: str, function: Callable[[], Any]) -> Any:
        """`function()` (safe to repeat), waiting out a lost Redis."""
        outage = Outage(f"the TransferQueue ({what})", self.config.outage_timeout_s)
        return outage.call(function, (TQUnavailableError,))

    def resume(self, step: int, feeder_state: dict[str, Any] | None, refill_groups: int) -> None:
        """Rewinds the queue to the restored step: the groups consumed at `step` or later (by
        a run whose weights after them are lost) go back to scored; at step 0, with no
        checkpoint, that is every consumed group. The feeder continues from its checkpointed
        state (None: from the start) and adopts the groups issued after it."""
        self.refill_groups = refill_groups
        returned = self._through_outage(
            "resume", lambda: self.tq.reset_consumption(self.partition, after_step=step - 1)
        )
        if returned:
            logger.info("resume at step %d: %d groups back to scored", step, len(returned))
        if self.feeder is not None:
            feeder = self.feeder
            if feeder_state is not None:
                feeder.load_state_dict(feeder_state)
            adopted = self._through_outage("resume", feeder.adopt_existing)
            if adopted:
                logger.info("resume: %d groups were issued after the checkpoint", adopted)
            # evicted after the checkpoint by a trainer that died before it saved again: its
            # prompt is re-issued, with the one new group the eviction earned (refill credit)
            for group in self._through_outage("resume", feeder.dropped_in_flight):
                self._retry(group, "stale", "evicted as too stale before a restart", step)
                self.refill_groups += 1

    def feed(self, step: int) -> None:
        """Issues the prompts step `step` needs (its batch, eta steps ahead, and the refills
        granted so far) and tells the gateway the step, so its throttle admits them."""
        shape = self.config.rollout_shape
        if self.feeder is not None:
            feeder = self.feeder
            target = self.mode.groups_to_issue(step, shape.batch_groups, shape.eta)
            self._through_outage(
                "issuing prompts", lambda: feeder.issue_up_to(target + self.refill_groups, step)
            )
        self._announce(step)

    def _announce(self, step: int) -> None:
        """UpdatePolicyStep, once. A gateway that is down or restarting is not an error: the
        leader announces again every `ANNOUNCE_INTERVAL_S` while it waits (`_on_wait`), so a
        restarted gateway, which starts at step 0, learns the step within seconds."""
        self._announced_at = time.monotonic()
        if self.gateway is None:
            return
        try:
            self.gateway.update_policy_step(
                step, self.config.rollout_shape.batch_groups, self.refill_groups, attempts=1
            )
        except grpc.RpcError as exc:
            logger.warning(
                "could not tell the gateway step %d (%s: %s); retrying while waiting",
                step,
                exc.code().name,
                exc.details(),
            )

    def _on_wait(self, step: int) -> None:
        if time.monotonic() - self._announced_at >= ANNOUNCE_INTERVAL_S:
            self._announce(step)

    def _refill(self, step: int, count: int) -> None:
        """Replacements for groups the step could not use are issued at once: the step is
        still waiting for them."""
        self.refill_groups += count
        self.feed(step)

    def judge(self, group: GroupWithTrajectories, step: int) -> Verdict:
        """The group's verdict (`judge_group`). The feeder re-issues the prompt of a group that
        cannot be trained for a reason outside the policy; its curriculum learns the outcome of
        any other. A group whose prompt was re-issued before a restart (as too stale: every
        other such verdict is the same again) is stale whatever it holds now, so that its
        prompt is not trained twice for one issue (docs/recovery.md#prompts-across-a-restart)."""
        verdict = judge_group(group, use_dapo_filter=self.config.algorithm.dapo_filter)
        if self.feeder is None:
            return verdict
        if verdict not in RETRY_CAUSES and self.feeder.reissued(group.group):
            verdict = "stale"  # the sampler hands it to `_discard` too: heard once, no-op then
        if verdict in RETRY_CAUSES:
            reason = (
                "re-issued before a restart" if verdict == "stale" else group_failure_text(group)
            )
            self._retry(group.group, verdict, reason, step)
        else:
            rewards = [t.reward.score for t in group.trajectories if is_valid(t)]
            self.feeder.observe(group.group, step, rewards)
        return verdict

    def _discard(self, groups: list[common_pb2.PromptGroup], step: int) -> None:
        """Groups the staleness gate took out of play: their prompts are re-issued."""
        threshold = self.config.staleness_threshold
        for group in groups:
            staleness = step - group.tags.prompt_step + 1
            reason = f"staleness {staleness} > {threshold} at step {step}"
            self._retry(group, "stale", reason, step)

    def _retry(
        self, group: common_pb2.PromptGroup, cause: RetryCause, reason: str, step: int
    ) -> None:
        """Re-issues `group`'s prompt; past its budget, skips it or ends the run
        (`data.retry.on_exhausted`)."""
        assert self.feeder is not None
        skipped = self.feeder.retry(group, cause, reason)
        if skipped is None:
            return
        what = (
            f"prompt {skipped.index} could not be trained after {skipped.retries} re-issues "
            f"(its last group {skipped.group}: {cause}, {reason})"
        )
        if self.config.data.retry.on_exhausted == "stop":
            self.watch.stop(step, f"{what}; data.retry.on_exhausted is stop")
        logger.warning("step %d: %s; skipped", step, what)

    def sample(
        self, step: int, stop: Callable[[], bool]
    ) -> tuple[list[ScoredGroup], StepMetrics, float]:
        sample = self.sampler.sample(
            step,
            self.config.rollout_shape.batch_groups,
            lambda group: self.judge(group, step),
            lambda count: self._refill(step, count),
            stop,
            on_wait=lambda: self._on_wait(step),
            discard=lambda groups: self._discard(groups, step),
        )
        groups = scored_groups(sample.kept, step, self.config.model.max_seq_len)
        metrics = self._sample_metrics(step, sample)
        metrics.staleness = [step - g.prompt_step + 1 for g in groups]
        # The simulator's staleness, i.e. policy lag (docs/staleness.md#definitions): versions
        # between the one that launched a group's oldest token and the one this step trains;
        # 0 is on-policy.
        metrics.policy_lag = [step - min(r.min_policy_version for r in g.rows) for g in groups]
        metrics.launched_lengths = [
            sum(row.response_len for row in r.sample_rows()) for g in groups for r in g.rows
        ]
        return groups, metrics, sample.waited_s

    def _sample_metrics(self, step: int, sample: Sample) -> StepMetrics:
        """What the step consumed: verdicts, their reasons and tokens, failed rollouts, the
        curriculum's set-asides, and whether the filter's budget ran out (said in the log)."""
        metrics = StepMetrics(step=step)
        metrics.groups = {"keep": len(sample.kept), **sample.rejected}
        if sample.num_evicted:
            metrics.groups["evicted"] = sample.num_evicted
        if self.feeder is not None:
            curriculum = self.feeder.curriculum
            metrics.values["epoch"] = float(curriculum.epoch)
            metrics.set_aside = [
                {"prompt": a.index, "epoch": a.epoch, "epochs": a.epochs, "reason": a.reason}
                for a in curriculum.take_set_aside()
            ]
            retried, skipped = curriculum.take_retries()
            metrics.retried = dict(retried)
            metrics.skipped = [
                {
                    "prompt": s.index,
                    "uid": s.group,
                    "retries": s.retries,
                    "cause": s.cause,
                    "reason": s.reason,
                }
                for s in skipped
            ]
        tally = self.watch.step_tally()
        metrics.no_signal, metrics.failures = tally.no_signal, tally.failures
        metrics.generated_tokens = tally.tokens
        metrics.values["rollouts"] = float(tally.rollouts)
        metrics.values["failed_rollouts"] = float(tally.failed_rollouts)
        if sample.budget_spent:
            metrics.values["filter_budget_spent"] = 1.0
            logger.warning(
                "step %d: the filter's budget is spent (%d groups consumed for %d): training on "
                "the %d kept",
                step,
                sample.num_consumed,
                self.config.rollout_shape.batch_groups,
                len(sample.kept),
            )
        return metrics


class TrainingLoop:
    """Runs on every rank. `leader` is None on ranks other than 0; on rank 0 it holds the
    same `mode` instance as the loop. Built by `TrainerConfig.build_loop`."""

    def __init__(
        self,
        config: TrainerConfig,
        policy: Policy,
        *,
        mode: TrainerMode,
        publisher: WeightPublisher,
        updater: Updater,
        leader: Leader | None = None,
        metrics: TrainerMetrics | None = None,
        control: Control | None = None,
        status: Status | None = None,
    ) -> None:
        assert leader is None or leader.mode is mode, "the leader and the loop share one mode"
        self.config = config
        self.model = policy.model
        self.optimizer = policy.optimizer
        self.scheduler = policy.scheduler
        self.spec = policy.spec
        self.leader = leader
        self.metrics = metrics
        self.mode = mode
        self.publisher = publisher
        self.control = control or Control()
        self.status = status or Status()
        self.updater = updater
        self.step = 0

    @property
    def is_leader(self) -> bool:
        return self.leader is not None

    # -- checkpoints -------------------------------------------------------------------------

    def restore(self) -> None:
        """Loads the latest checkpoint (if any) on every rank; the leader then rewinds the
        TransferQueue and the feeder to it."""
        from relayrl.trainer.checkpointing import latest_checkpoint, load_checkpoint

        settings = self.config.checkpoint
        common: dict[str, Any] = {}
        if settings.dir is not None and settings.resume:
            path = latest_checkpoint(settings.dir)
            if path is not None:
                common = load_checkpoint(path, self.model, self.optimizer)
                self.scheduler.load_state_dict(common["scheduler"])
                self.status.last_checkpoint_step = common["step"] - 1
                logger.info("resumed from %s (next step %d)", path, common["step"])
        self.step = int(common.get("step", 0))
        self.status.step = self.step
        if self.leader is not None:
            self.leader.resume(self.step, common.get("feeder"), int(common.get("refill_groups", 0)))
        # Rollout may hold versions published after this checkpoint (or, with no checkpoint,
        # after the initial weights), from weights this run has lost: put the engines back on
        # the ones it continues from, under the same version number -- a checkpoint of step k
        # holds exactly the weights published as version k (collective).
        committed = self._broadcast(self.publisher.committed_version() if self.is_leader else None)
        if self.step > 0 or (committed is not None and committed != self.step):
            self.publisher.publish(self.step, self.model, self.spec, supersede=True)
            logger.info(
                "republished version %d (the %s weights; rollout held version %s)",
                self.step,
                "checkpoint's" if self.step else "initial",
                "unknown" if committed is None else committed,
            )
        self.publisher.begin(self.step, self.model, self.spec)
        self.status.published_version = self.step

    def save(self) -> None:
        from relayrl.trainer.checkpointing import save_checkpoint

        settings = self.config.checkpoint
        if settings.dir is None:
            return
        previous = self.status.state
        self.status.state = State.CHECKPOINTING
        leader = self.leader
        # The leader's cursors are the ones that count; every rank's RNG states are saved by
        # save_checkpoint itself.
        common = self._broadcast(
            {
                "step": self.step,
                "feeder": leader.feeder.state_dict() if leader and leader.feeder else None,
                "refill_groups": leader.refill_groups if leader else 0,
                "scheduler": self.scheduler.state_dict(),
            }
        )
        save_checkpoint(settings.dir / f"step-{self.step:08d}", self.model, self.optimizer, common)
        if self.is_leader:
            _prune_checkpoints(settings.dir, settings.keep)
        self.status.last_checkpoint_step = self.step - 1
        self.status.state = previous

    # -- steps -------------------------------------------------------------------------------

    def _next_batch(self) -> tuple[list[ScoredGroup] | None, StepMetrics | None, float]:
        """Leader: waits out a pause, then feeds and samples; None means stop."""
        assert self.leader is not None
        control = self.control
        while control.paused and not control.stop:
            self.status.state = State.PAUSED
            control.wake.wait(0.5)
            control.wake.clear()
        if control.stop or self.step >= self.config.total_steps:
            return None, None, 0.0
        self.status.state = State.WAITING
        self.leader.feed(self.step)
        try:
            return self.leader.sample(self.step, lambda: control.stop)
        except SamplingStopped:
            return None, None, 0.0

    def _broadcast(self, payload: Any) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return payload
        holder = [payload]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def run(self) -> None:
        """Trains until total_steps, or until the leader is told to stop."""
        while True:
            step_start = time.perf_counter()
            if self.is_leader:
                groups, metrics, waited = self._next_batch()
                payload = None if groups is None else (groups, metrics, waited)
            else:
                payload = None
            payload = self._broadcast(payload)
            if payload is None:
                break
            groups, metrics, waited = payload
            self._train_step(groups, metrics, waited, step_start)
        self.publisher.finish(self.model, self.spec)
        self.status.published_version = self.publisher.rollout_version(self.step)
        self.status.state = State.STOPPED

    def _train_step(
        self, groups: list[ScoredGroup], metrics: StepMetrics, waited_s: float, start: float
    ) -> None:
        self.status.state = State.TRAINING
        rollout = self.leader.gateway if self.leader else None
        self.mode.before_update(rollout)
        try:
            result = self.updater.run(groups)
            publish_start = time.perf_counter()
            published = self.publisher.publish(self.step + 1, self.model, self.spec)
            result.phases_s["publish"] = time.perf_counter() - publish_start
        finally:
            self.mode.after_publish(rollout)
        self.step += 1
        self.status.step = self.step
        self.status.published_version = self.publisher.rollout_version(self.step)
        result.values.update(published)
        result.phases_s["wait"] = waited_s
        if self.leader is not None:
            self.leader.watch.step_completed()
            self._report(groups, metrics, result, start)
            if self.step < self.config.total_steps:  # rollout of the next step may start now
                self.leader.feed(self.step)
        checkpoint_now = self._broadcast(self.control.checkpoint_now if self.is_leader else None)
        if checkpoint_now or self.step % self.config.checkpoint.interval_steps == 0:
            self.save()
            self.control.checkpoint_now = False

    def _report(
        self, groups: list[ScoredGroup], metrics: StepMetrics, result: StepResult, start: float
    ) -> None:
        rows = [r for g in groups for r in g.rows if r.valid]
        rewards = [r.reward for r in rows]
        values = metrics.values
        values.update(result.values)
        duration = time.perf_counter() - start
        values["reward_mean"] = float(np.mean(rewards)) if rewards else 0.0
        values["reward_std"] = float(np.std(rewards)) if rewards else 0.0
        values["staleness_mean"] = float(np.mean(metrics.staleness)) if metrics.staleness else 0.0
        values["staleness_max"] = float(max(metrics.staleness, default=0))
        if metrics.policy_lag:
            values["policy_lag_mean"] = float(np.mean(metrics.policy_lag))
            values["policy_lag_max"] = float(max(metrics.policy_lag))
        values["step_duration_s"] = duration
        values["wait_duration_s"] = result.phases_s.get("wait", 0.0)
        train_s = duration - values["wait_duration_s"]
        values["tokens_per_s"] = values.get("trained_tokens", 0.0) / max(train_s, 1e-9)
        metrics.trained_lengths = [int(r.mask.sum()) for r in rows]
        metrics.row_tokens = result.row_tokens
        values["trained_response_len_mean"] = (
            float(np.mean(metrics.trained_lengths)) if rows else 0.0
        )
        values["launched_response_len_mean"] = (
            float(np.mean(metrics.launched_lengths)) if metrics.launched_lengths else 0.0
        )
        metrics.uids = [g.uid for g in groups]
        self.status.metrics = {k: v for k, v in values.items() if isinstance(v, float)}
        self.status.staleness_histogram = (
            dict(zip(*np.unique(metrics.staleness, return_counts=True), strict=True))
            if metrics.staleness
            else {}
        )
        if self.metrics is not None:
            self.metrics.published_version.set(self.status.published_version)
            self.metrics.observe(metrics, result.phases_s)
        logger.info(
            "step %d: reward %.3f, %d groups, staleness max %d, %.1fs",
            metrics.step,
            values["reward_mean"],
            len(groups),
            values["staleness_max"],
            duration,
        )


def _prune_checkpoints(root: Path, keep: int) -> None:
    import shutil

    snapshots = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in snapshots[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def data_parallel_from_megatron() -> DataParallel:
    from megatron.core import parallel_state

    return DataParallel(
        rank=parallel_state.get_data_parallel_rank(),
        size=parallel_state.get_data_parallel_world_size(),
        group=parallel_state.get_data_parallel_group(),
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
