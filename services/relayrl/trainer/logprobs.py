"""Token log-probs from the output layer's logits, in chunks of tokens, with a memory bound.

`log softmax(logits / temperature)` gathered at the next token is the trainer's hottest
tensor expression: the logits of a micro-batch are [b, T, V] with V = 49 152 (SmolLM2) to
152 064 (Qwen2), so every full-size intermediate costs as much as the logits themselves. The
plain autograd expression (divide by the temperature, slice off the last position, upcast,
megatron's vocab-parallel cross entropy) keeps four to five such tensors alive between the
forward and the backward pass. `chunked_token_logprobs` keeps none besides the logits:

- forward: per chunk of tokens, the log-sum-exp and the target's logit, computed in fp32 from
  the logits' own dtype; only the log-sum-exp ([b, T]) is saved;
- backward: per chunk, `d logp / d logits = (onehot(target) - softmax) / temperature`, the
  softmax recomputed from the saved logits and log-sum-exp, written into the logits' own
  storage (the output layer's backward does not read its output, and nothing else holds it),
  so the gradient costs no second [b, T, V] tensor either.

Under tensor parallelism `logits_btv` is this rank's vocabulary shard; the max, the sum of
exponentials and the target's logit are all-reduced over the tensor-parallel group, as
megatron's vocab-parallel cross entropy does, and each rank's gradient is its shard's.
The result equals the unchunked expression within fp32 rounding (tests/unit/trainer).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_TOKENS = 256
"""Tokens per chunk: an fp32 temporary of CHUNK_TOKENS x V (48 MiB for V = 49 152)."""


def _tp_group() -> Any:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _vocab_start(vocab_shard: int, group: Any) -> int:
    return 0 if group is None else torch.distributed.get_rank(group) * vocab_shard


class _ChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits_nv: torch.Tensor,
        targets_n: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> torch.Tensor:
        group = _tp_group()
        num, vocab = logits_nv.shape
        start = _vocab_start(vocab, group)
        local_n = targets_n - start
        in_shard_n = (local_n >= 0) & (local_n < vocab)
        local_n = torch.where(in_shard_n, local_n, torch.zeros_like(local_n))
        lse_n = torch.empty(num, dtype=torch.float32, device=logits_nv.device)
        target_n = torch.empty(num, dtype=torch.float32, device=logits_nv.device)
        for lo in range(0, num, chunk):
            z = logits_nv[lo : lo + chunk].float() / temperature
            top = z.max(dim=-1).values
            if group is not None:
                torch.distributed.all_reduce(top, torch.distributed.ReduceOp.MAX, group=group)
            z.sub_(top.unsqueeze(-1))
            picked = z.gather(1, local_n[lo : lo + chunk].unsqueeze(-1)).squeeze(-1)
            picked = torch.where(in_shard_n[lo : lo + chunk], picked, torch.zeros_like(picked))
            sum_exp = z.exp_().sum(dim=-1)
            if group is not None:
                torch.distributed.all_reduce(sum_exp, group=group)
                torch.distributed.all_reduce(picked, group=group)
            lse_n[lo : lo + chunk] = top + sum_exp.log()
            target_n[lo : lo + chunk] = picked + top
        ctx.save_for_backward(logits_nv, local_n, in_shard_n, lse_n)
        ctx.temperature, ctx.chunk = temperature, chunk
        return target_n - lse_n

    @staticmethod
    def backward(ctx: Any, grad_n: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        logits_nv, local_n, in_shard_n, lse_n = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        # The gradient overwrites the logits chunk by chunk (module docstring).
        grad_nv = logits_nv
        scale_n = grad_n.float() / temperature
        for lo in range(0, logits_nv.shape[0], chunk):
            rows = slice(lo, lo + chunk)
            p = (logits_nv[rows].float() / temperature).sub_(lse_n[rows].unsqueeze(-1)).exp_()
            hit = in_shard_n[rows]
            p[hit, local_n[rows][hit]] -= 1.0
            grad_nv[rows] = p.mul_(-scale_n[rows].unsqueeze(-1)).to(grad_nv.dtype)
        return grad_nv, None, None, None


def chunked_token_logprobs(
    logits_btv: torch.Tensor,
    targets_bt: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """float32 [b, t]: `log softmax(logits[b, t] / temperature)[targets[b, t]]`, where
    `logits_btv` is the full vocabulary or, under tensor parallelism, this rank's shard.

    The backward pass overwrites `logits_btv` with its gradient: the caller must not read the
    logits after calling backward (the module docstring says why it is safe in the trainer).
    """
    if not temperature > 0:
        raise ValueError(f"temperature {temperature} must be positive")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be >= 1")
    b, t, v = logits_btv.shape
    if targets_bt.shape != (b, t):
        raise ValueError(f"targets {tuple(targets_bt.shape)} do not match logits {(b, t, v)}")
    logp_n = _ChunkedTokenLogprob.apply(
        logits_btv.reshape(b * t, v), targets_bt.reshape(b * t), temperature, chunk_tokens
    )
    return logp_n.view(b, t)
