"""The training step on real megatron-core (CPU, gloo), in spawned rank processes.

- lag 0 (rollout log-probs = the current policy's) with every correction switched on trains
  exactly like a plain on-policy PPO step written out by hand (docs/algorithms.md#decoupled-ppo);
- pi_old is the step's starting policy for all k local updates (separate_async);
- one step gives the same weights at DP 1, DP 2 and TP 2 (the loss denominator is global);
- a sample's segments train as rows of their own with the sample's advantage, the loss counting
  every segment's tokens (docs/architecture.md#segments).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.trainer.batch import Row, ScoredGroup
from relayrl.trainer.config import AlgorithmConfig
from relayrl.trainer.model import spawn_ranks

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 6, 7]


def make_groups(num_groups: int, seed: int = 0) -> list[ScoredGroup]:
    """Synthetic scored groups: random responses, rewards with signal, mu = -3 everywhere."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        rows = []
        for i in range(4):
            response = [*rng.integers(3, 500, size=int(rng.integers(3, 9))).tolist(), 2]
            ids = np.asarray(PROMPT + response, dtype=np.int64)
            mask = np.zeros(len(ids), np.float32)
            mask[len(PROMPT) :] = 1
            rows.append(
                Row(
                    uid=f"g{g}",
                    index=i,
                    input_ids=ids,
                    prompt_len=len(PROMPT),
                    mask=mask,
                    rollout_logp=mask * -3.0,
                    reward=float((i + g) % 3 == 0),
                    valid=True,
                    staleness=1,
                    min_policy_version=0,
                    max_policy_version=0,
                )
            )
        groups.append(ScoredGroup(f"g{g}", 0, rows))
    return groups


def build(model_dir: Path, tp: int, lr: float = 1e-3, adam_eps: float = 1e-8):
    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir

    init_parallel(tp, seed=0)
    spec = ModelSpec.from_hf_dir(model_dir)
    model = build_model(spec)
    load_hf_dir(model, model_dir)
    optimizer = OptimizerConfig(lr=lr, eps=adam_eps, clip_grad=0.0).build(model)
    return spec, model, optimizer


class NoSchedule:
    def step(self, increment: int) -> None:
        pass


def data_parallel():
    from relayrl.trainer.loop import data_parallel_from_megatron

    return data_parallel_from_megatron()


def exported(model, spec) -> dict[str, torch.Tensor]:
    from relayrl.trainer.hf_mapping import export_hf_tensors

    return {name: t.clone() for name, t in export_hf_tensors(model, spec)}


def set_on_policy(model, groups: list[ScoredGroup]) -> None:
    """Rollout log-probs = the current policy's (lag 0)."""
    from relayrl.trainer.batch import collate
    from relayrl.trainer.forward import TokenBatch, forward_logprobs

    rows = [r for g in groups for r in g.train_rows()]
    batch = collate(rows)
    logp = forward_logprobs(
        model, TokenBatch(batch.input_ids_BT, batch.lengths_B), micro_batch_size=4
    )
    for b, row in enumerate(rows):
        row.rollout_logp = (logp[b, : len(row.input_ids)].numpy() * row.mask).astype(np.float32)


# -- lag 0 == on-policy -------------------------------------------------------------------


def _lag0_rank(rank: int, world_size: int, model_dir: Path, path: str) -> dict[str, torch.Tensor]:
    from relayrl.trainer.step import PolicyUpdater

    spec, model, optimizer = build(model_dir, tp=1, lr=0.3, adam_eps=1.0)  # linear in g
    algorithm = AlgorithmConfig.model_validate(
        {
            "micro_batch_size": 2,
            "loss": {
                "importance_sampling": {"kind": "tis", "cap": 2.0, "level": "token"},
                "rejection": [{"metric": "k3", "level": "token", "high": 0.5}],
            },
        }
    )
    for step in range(3):
        groups = make_groups(2, seed=step)
        set_on_policy(model, groups)
        if path == "relayrl":
            PolicyUpdater(algorithm, model, optimizer, NoSchedule()).run(groups)
        else:
            hand_written_on_policy_step(model, optimizer, groups, algorithm)
    return exported(model, spec)


def hand_written_on_policy_step(model, optimizer, groups, algorithm) -> None:
    """Plain on-policy GRPO/PPO: A from the group, ratio against a detached copy of logp,
    token-mean over the batch; no pi_old pass, no IS, no rejection."""
    from relayrl.trainer.batch import collate
    from relayrl.trainer.forward import TokenBatch, forward_backward, optimizer_step

    for g in groups:
        r = np.asarray(g.rewards)
        adv = (r - r.mean()) / (r.std(ddof=1) + algorithm.advantage.eps)
        for sample, a in zip(g.rows, adv, strict=True):
            for row in [sample, *sample.segments]:  # a sample's segments share its advantage
                row.advantage = float(a)
    rows = [row for g in groups for sample in g.rows for row in [sample, *sample.segments]]
    batch = collate(rows)
    num_tokens = float(batch.mask_BT.sum())
    eps_low, eps_high = algorithm.loss.clip.eps_low, algorithm.loss.clip.eps_high

    def loss_fn(logp, rows_slice):
        mask, adv = batch.mask_BT[rows_slice], batch.advantages_B[rows_slice].unsqueeze(1)
        ratio = torch.exp(logp - logp.detach())
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        return (per_token * mask).sum() / num_tokens, {}

    forward_backward(
        model,
        TokenBatch(batch.input_ids_BT, batch.lengths_B),
        micro_batch_size=2,
        temperature=1.0,
        loss_fn=loss_fn,
    )
    optimizer_step(optimizer)


def test_lag_zero_with_corrections_on_reproduces_on_policy_training(model_dir: Path) -> None:
    [ours] = spawn_ranks(_lag0_rank, 1, model_dir, "relayrl")
    [reference] = spawn_ranks(_lag0_rank, 1, model_dir, "reference")
    initial = make_reference_weights(model_dir)
    moved = max(float((t - initial[n]).abs().max()) for n, t in reference.items())
    assert moved > 1e-3  # three steps really moved the weights
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=moved * 1e-4, msg=name)


def with_segments(groups: list[ScoredGroup]) -> list[ScoredGroup]:
    """Every sample gets a second segment: another prompt, another response, its reward."""
    rng = np.random.default_rng(7)
    for group in groups:
        for row in group.rows:
            prompt = [1, 9, 8]
            response = [*rng.integers(3, 500, size=int(rng.integers(3, 9))).tolist(), 2]
            ids = np.asarray(prompt + response, dtype=np.int64)
            mask = np.zeros(len(ids), np.float32)
            mask[len(prompt) :] = 1
            row.segments.append(
                Row(
                    uid=row.uid,
                    index=row.index,
                    input_ids=ids,
                    prompt_len=len(prompt),
                    mask=mask,
                    rollout_logp=mask * -3.0,
                    reward=row.reward,
                    valid=True,
                    staleness=1,
                    min_policy_version=0,
                    max_policy_version=0,
                    segment=1,
                )
            )
    return groups


def _segments_rank(
    rank: int, world_size: int, model_dir: Path, path: str
) -> dict[str, torch.Tensor]:
    from relayrl.trainer.step import PolicyUpdater

    spec, model, optimizer = build(model_dir, tp=1, lr=0.3, adam_eps=1.0)  # linear in g
    algorithm = AlgorithmConfig.model_validate({"micro_batch_size": 2})
    groups = with_segments(make_groups(2, seed=3))
    set_on_policy(model, groups)
    if path == "relayrl":
        PolicyUpdater(algorithm, model, optimizer, NoSchedule()).run(groups)
    else:
        hand_written_on_policy_step(model, optimizer, groups, algorithm)
    return exported(model, spec)


def test_a_samples_segments_train_with_its_advantage_and_every_token_counts(
    model_dir: Path,
) -> None:
    [ours] = spawn_ranks(_segments_rank, 1, model_dir, "relayrl")
    [reference] = spawn_ranks(_segments_rank, 1, model_dir, "reference")
    initial = make_reference_weights(model_dir)
    moved = max(float((t - initial[n]).abs().max()) for n, t in reference.items())
    assert moved > 1e-3
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=moved * 1e-4, msg=name)


def make_reference_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


# -- pi_old held for k updates --------------------------------------------------------------


def _pi_old_rank(rank: int, world_size: int, model_dir: Path) -> dict:
    from relayrl.trainer.batch import collate
    from relayrl.trainer.forward import TokenBatch, forward_logprobs
    from relayrl.trainer.step import PolicyUpdater, _mini_batches, _rows_per_group

    _, model, optimizer = build(model_dir, tp=1, lr=1e-2)
    algorithm = AlgorithmConfig.model_validate(
        {
            "mode": "separate_async",
            "parameter_sync_step": 2,
            "micro_batch_size": 4,
        }
    )
    groups = make_groups(4)
    rows = [r for g in groups for r in g.rows]
    batch = collate(rows)
    tokens = TokenBatch(batch.input_ids_BT, batch.lengths_B)
    logp_start = forward_logprobs(model, tokens, micro_batch_size=4) * batch.mask_BT
    result = PolicyUpdater(algorithm, model, optimizer, NoSchedule()).run(groups)
    logp_end = forward_logprobs(model, tokens, micro_batch_size=4) * batch.mask_BT
    updates = _mini_batches(_rows_per_group(groups, rows), 2)
    return {
        "used": result.old_logp_checksums,
        "start": [float(logp_start[ids].sum()) for ids in updates],
        "end": [float(logp_end[ids].sum()) for ids in updates],
    }


def test_pi_old_is_the_starting_policy_for_all_k_updates(model_dir: Path) -> None:
    [out] = spawn_ranks(_pi_old_rank, 1, model_dir)
    assert len(out["used"]) == 2
    np.testing.assert_allclose(out["used"], out["start"], rtol=1e-6)
    # the weights moved enough that a recomputed pi_old would have been different
    assert abs(out["end"][1] - out["start"][1]) > 1e-3


# -- layouts --------------------------------------------------------------------------------


def _layout_rank(rank: int, world_size: int, model_dir: Path, tp: int) -> dict[str, torch.Tensor]:
    from relayrl.trainer.step import PolicyUpdater

    # Adam's first step is lr * g / (|g| + eps): with eps >> |g| it is linear in the gradient,
    # so the weights compare the gradients (with eps 1e-8 it would be sign(g), and entries with
    # |g| ~ 1e-8 would turn float noise into lr-sized differences).
    spec, model, optimizer = build(model_dir, tp=tp, lr=1.0, adam_eps=1.0)
    algorithm = AlgorithmConfig.model_validate(
        {
            "micro_batch_size": 2,
            "loss": {"aggregation": "seq-mean-token-mean"},
        }
    )
    PolicyUpdater(algorithm, model, optimizer, NoSchedule(), data_parallel=data_parallel()).run(
        make_groups(3)
    )
    return exported(model, spec)


def test_one_step_gives_the_same_weights_at_dp1_dp2_and_tp2(model_dir: Path) -> None:
    [single] = spawn_ranks(_layout_rank, 1, model_dir, 1)
    dp2 = spawn_ranks(_layout_rank, 2, model_dir, 1)
    tp2 = spawn_ranks(_layout_rank, 2, model_dir, 2)
    initial = make_reference_weights(model_dir)
    moved = max(float((t - initial[n]).abs().max()) for n, t in single.items())
    assert moved > 1e-3
    for name, tensor in single.items():
        for other in (*dp2, *tp2):
            torch.testing.assert_close(other[name], tensor, rtol=0, atol=moved * 1e-4, msg=name)


# -- reference policy -----------------------------------------------------------------------


def _reference_rank(rank: int, world_size: int, model_dir: Path) -> list[float]:
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, load_hf_dir
    from relayrl.trainer.step import PolicyUpdater

    _, model, optimizer = build(model_dir, tp=1, lr=1e-2)
    ref_model = build_model(ModelSpec.from_hf_dir(model_dir))
    load_hf_dir(ref_model, model_dir)
    algorithm = AlgorithmConfig.model_validate({"micro_batch_size": 4, "loss": {"kl_coef": 0.1}})
    updater = PolicyUpdater(algorithm, model, optimizer, NoSchedule(), ref_model=ref_model)
    return [updater.run(make_groups(2, seed=s)).values["ref_kl"] for s in range(2)]


def test_kl_to_the_reference_is_zero_until_the_policy_moves(model_dir: Path) -> None:
    [(first, second)] = spawn_ranks(_reference_rank, 1, model_dir)
    assert first == pytest.approx(0.0, abs=1e-6)  # pi_old is still the reference
    assert second > 1e-4
