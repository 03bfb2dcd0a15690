"""One training step on a batch of kept prompt groups: the algorithm, between the replay buffer
and the optimizer.

    advantages (per group) -> pi_old (forward-only, once) [-> pi_ref]
    -> IS weights and rejection mask on the whole batch -> k local updates on mini-batches

Every rank holds the whole step batch (rank 0 broadcasts it) and computes the same advantages,
weights and masks; forward passes are split across data-parallel ranks and their log-probs
gathered, so batch-level quantities (IS batch normalisation, mismatch metrics, the loss
denominator) are computed over the global batch, never per rank or per micro-batch.
pi_old is computed once, on the weights the step starts from, and held for all k updates.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from relayrl.trainer.advantages import GroupRewards, group_advantages
from relayrl.trainer.batch import Row, ScoredGroup, TensorBatch, collate
from relayrl.trainer.config import AlgorithmConfig
from relayrl.trainer.forward import TokenBatch, forward_backward, forward_logprobs, optimizer_step
from relayrl.trainer.losses import (
    aggregate,
    is_weights,
    kl_penalty,
    loss_denominator,
    mismatch_metrics,
    ppo_loss_terms,
    rejection_mask,
)
from relayrl.trainer.runtime import LRScheduler, PolicyModel, PolicyOptimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among data-parallel ranks (TP ranks of one DP slice share rows)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def shard(self, num_rows: int, micro_batch_size: int) -> tuple[list[int], int]:
        """Row indices of this rank (strided, so every rank gets long and short rows alike),
        and the row count every rank pads to (a multiple of the micro-batch size)."""
        per_rank = math.ceil(num_rows / self.size) if num_rows else 0
        per_rank = max(micro_batch_size, math.ceil(per_rank / micro_batch_size) * micro_batch_size)
        return list(range(self.rank, num_rows, self.size)), per_rank


@dataclass
class StepResult:
    values: dict[str, float] = field(default_factory=dict)
    # sum of pi_old over the trained tokens as seen by each local update: equal across the k
    # updates by construction (the tests hold the trainer to it).
    old_logp_checksums: list[float] = field(default_factory=list)
    phases_s: dict[str, float] = field(default_factory=dict)
    row_tokens: list[int] = field(default_factory=list)  # prompt + response of each row, in order


class Updater(Protocol):
    """What the loop asks of a step's update: train on the kept groups, report."""

    def run(self, groups: list[ScoredGroup]) -> StepResult: ...


class EmulatedUpdater:
    """BENCHMARK ONLY: stands in for `PolicyUpdater` with a fixed sleep, so that a pipeline
    benchmark measures rollout, reward, queue and weight sync around a training step of a
    known duration (`research.emulated_update_s`). Nothing is learned; every step reports
    `emulated_update = 1` so that no record can pass for a trained one."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        logger.warning(
            "research.emulated_update_s = %.3f: the policy update is a sleep (benchmark only); "
            "this trainer learns nothing",
            seconds,
        )

    def run(self, groups: list[ScoredGroup]) -> StepResult:
        start = time.perf_counter()
        time.sleep(self._seconds)
        rows = [r for g in groups for r in g.train_rows() if r.valid]
        return StepResult(
            values={"emulated_update": 1.0, "trained_rows": float(len(rows))},
            phases_s={"update": time.perf_counter() - start},
        )


def assign_advantages(groups: list[ScoredGroup], algorithm: AlgorithmConfig) -> None:
    inputs = [GroupRewards(g.uid, g.rewards, [not v for v in g.valid]) for g in groups]
    for group, result in zip(groups, group_advantages(inputs, algorithm.advantage), strict=True):
        for sample, advantage in zip(group.rows, result.advantages, strict=True):
            for row in sample.sample_rows():  # a sample's segments share its advantage
                row.advantage = float(advantage) if row.valid else 0.0


class PolicyUpdater:
    """Runs steps for one rank: `model` is megatron's DDP-wrapped GPTModel, `optimizer` and
    `scheduler` megatron's, `ref_model` a frozen copy when a KL penalty is configured."""

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        model: PolicyModel,
        optimizer: PolicyOptimizer,
        scheduler: LRScheduler,
        *,
        ref_model: PolicyModel | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self._algorithm = algorithm
        self._model = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._ref_model = ref_model
        self._dp = data_parallel or DataParallel()
        self._model_s = 0.0
        if algorithm.old_logprobs == "bypass":
            logger.warning(
                "old_logprobs: bypass uses the rollout log-probs as pi_old; the train/inference "
                "mismatch metrics are not reported (they would compare mu with itself)"
            )

    # -- forward passes over the global batch ------------------------------------------------

    def _global_logprobs(self, model: PolicyModel, batch: TensorBatch) -> torch.Tensor:
        """log-probs [B, T] of every row, each rank computing its shard."""
        mbs = self._algorithm.micro_batch_size
        indices, per_rank = self._dp.shard(batch.num_rows, mbs)
        local = _pad_rows(batch, indices, per_rank)
        start = time.perf_counter()
        logp = forward_logprobs(
            model,
            TokenBatch.scoring(local.input_ids_BT, local.lengths_B, local.mask_BT),
            micro_batch_size=mbs,
            micro_batch_tokens=self._algorithm.micro_batch_tokens,
            temperature=self._algorithm.temperature,
        )
        self._model_s += time.perf_counter() - start
        if self._dp.size == 1:
            return logp[: batch.num_rows]
        shards = [torch.empty_like(logp) for _ in range(self._dp.size)]
        dist.all_gather(shards, logp.contiguous(), group=self._dp.group)
        out = torch.zeros_like(batch.mask_BT)
        for rank, shard in enumerate(shards):
            rows = list(range(rank, batch.num_rows, self._dp.size))
            out[rows] = shard[: len(rows)]
        return out

    # -- the step ---------------------------------------------------------------------------

    def run(self, groups: list[ScoredGroup]) -> StepResult:
        algorithm = self._algorithm
        result = StepResult()
        self._model_s = 0.0
        clock = time.perf_counter()
        assign_advantages(groups, algorithm)
        rows = [r for g in groups for r in g.train_rows() if r.valid and r.mask.any()]
        if not rows:
            raise ValueError("a step needs at least one trainable trajectory")
        batch = collate(rows)
        mask = batch.mask_BT

        if algorithm.old_logprobs == "recompute":
            old_logp = self._global_logprobs(self._model, batch) * mask
        else:  # bypass: mu stands in for pi_old (docs/algorithms.md#bypass)
            old_logp = batch.rollout_logp_BT.clone()
        ref_logp = None
        if self._ref_model is not None:
            ref_logp = self._global_logprobs(self._ref_model, batch) * mask
        result.phases_s["old_logprobs"] = time.perf_counter() - clock

        loss = algorithm.loss
        weights, is_metrics = is_weights(
            old_logp, batch.rollout_logp_BT, mask, loss.importance_sampling
        )
        keep, rejection_metrics = rejection_mask(
            old_logp, batch.rollout_logp_BT, mask, loss.rejection
        )
        train_mask = mask * keep.to(mask.dtype)
        values = result.values
        values.update(is_metrics)
        values.update(rejection_metrics)
        if algorithm.old_logprobs == "recompute":
            values.update(mismatch_metrics(old_logp, batch.rollout_logp_BT, mask))
        if ref_logp is not None:
            # k3: never negative on a finite sample, so it reads as a distance on a dashboard
            values["ref_kl"] = float(
                (kl_penalty(old_logp, ref_logp, mask, "k3") * mask).sum() / mask.sum()
            )

        update_clock = time.perf_counter()
        updates = []
        group_rows = _rows_per_group(groups, rows)
        for row_ids in _mini_batches(group_rows, algorithm.parameter_sync_step):
            updates.append(
                self._update(batch, row_ids, old_logp, ref_logp, weights, train_mask, result)
            )
        result.phases_s["update"] = time.perf_counter() - update_clock
        # forward, backward (with the loss) and optimizer: the part that is not overhead
        result.phases_s["model"] = self._model_s
        for key in updates[0]:
            values[key] = float(np.mean([u[key] for u in updates]))
        # trained tokens: prompt and response of every row, what the model's passes compute
        # (docs/algorithms.md#trained-tokens); the response part is the loss's share of them
        values["trained_tokens"] = float(batch.lengths_B.sum())
        values["response_tokens"] = float(mask.sum())
        result.row_tokens = batch.lengths_B.tolist()
        values["num_updates"] = float(len(updates))
        return result

    def _update(
        self,
        batch: TensorBatch,
        row_ids: list[int],
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        weights: torch.Tensor,
        train_mask: torch.Tensor,
        result: StepResult,
    ) -> dict[str, float]:
        algorithm, loss = self._algorithm, self._algorithm.loss
        mbs = algorithm.micro_batch_size
        denominator = loss_denominator(train_mask[row_ids], loss.aggregation)
        local_pos, per_rank = self._dp.shard(len(row_ids), mbs)
        local_ids = [row_ids[i] for i in local_pos]
        local = _pad_rows(batch, local_ids, per_rank)
        padded = len(local_ids)

        def take(tensor: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((per_rank, *tensor.shape[1:]), dtype=tensor.dtype)
            out[:padded] = tensor[local_ids]
            return out

        old_l, w_l, mask_l = take(old_logp), take(weights), take(train_mask)
        ref_l = take(ref_logp) if ref_logp is not None else None
        adv_l = local.advantages_B
        result.old_logp_checksums.append(float((old_l * mask_l).sum()))
        micro_metrics: list[dict[str, float]] = []

        def loss_fn(logp_bT: torch.Tensor, rows: slice) -> tuple[torch.Tensor, dict[str, float]]:
            m = mask_l[rows]
            per_token, metrics = ppo_loss_terms(
                logp_bT, old_l[rows], adv_l[rows], w_l[rows], m, loss.clip
            )
            if ref_l is not None and loss.kl_coef > 0:
                per_token = per_token + loss.kl_coef * kl_penalty(
                    logp_bT, ref_l[rows], m, loss.kl_estimator
                )
            contribution = aggregate(per_token, m, loss.aggregation, denominator)
            metrics = dict(metrics, loss=float(contribution.detach()))
            micro_metrics.append(metrics)
            return contribution, metrics

        start = time.perf_counter()
        forward_backward(
            self._model,
            TokenBatch.scoring(local.input_ids_BT, local.lengths_B, local.mask_BT),
            micro_batch_size=mbs,
            micro_batch_tokens=algorithm.micro_batch_tokens,
            temperature=algorithm.temperature,
            loss_fn=loss_fn,
        )
        success, grad_norm = optimizer_step(self._optimizer)
        self._model_s += time.perf_counter() - start
        self._scheduler.step(increment=1)
        out = {
            "loss": _sum_over_dp(sum(m["loss"] for m in micro_metrics), self._dp),
            "grad_norm": float(grad_norm),
            "update_skipped": float(not success),
            "lr": float(self._optimizer.param_groups[0]["lr"]),
        }
        for key in ("pg_clipfrac", "pg_approx_kl"):
            if micro_metrics and key in micro_metrics[0]:
                out[key] = float(np.mean([m[key] for m in micro_metrics]))
        return out


def _sum_over_dp(value: float, dp: DataParallel) -> float:
    if dp.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=dp.group)
    return float(tensor[0])


def _pad_rows(batch: TensorBatch, indices: list[int], num_rows: int) -> TensorBatch:
    """The rows `indices` of `batch`, padded with empty rows (length 1, mask 0) to num_rows."""
    T = batch.input_ids_BT.shape[1]
    out = TensorBatch(
        torch.zeros(num_rows, T, dtype=torch.int64),
        torch.ones(num_rows, dtype=torch.int64),
        torch.zeros(num_rows, T),
        torch.zeros(num_rows, T),
        torch.zeros(num_rows),
        [""] * num_rows,
    )
    if indices:
        n = len(indices)
        out.input_ids_BT[:n] = batch.input_ids_BT[indices]
        out.lengths_B[:n] = batch.lengths_B[indices]
        out.mask_BT[:n] = batch.mask_BT[indices]
        out.rollout_logp_BT[:n] = batch.rollout_logp_BT[indices]
        out.advantages_B[:n] = batch.advantages_B[indices]
        out.keys[:n] = [batch.keys[i] for i in indices]
    return out


def _rows_per_group(groups: list[ScoredGroup], rows: list[Row]) -> list[list[int]]:
    position = {id(r): i for i, r in enumerate(rows)}
    return [[position[id(r)] for r in g.train_rows() if id(r) in position] for g in groups]


def _mini_batches(group_rows: list[list[int]], k: int) -> list[list[int]]:
    """k mini-batches of whole groups (a group's members are never split across updates)."""
    chunks = np.array_split(np.arange(len(group_rows)), k)
    out = [[i for g in chunk for i in group_rows[g]] for chunk in chunks]
    return [c for c in out if c]
