"""The two schedule entry points of the training loop, both through megatron's
`get_forward_backward_func()`: log-probs of given tokens (forward only: old/ref policy) and a
forward-backward pass with a caller-supplied loss (the policy update), plus the optimizer step.

Gradient contract of `forward_backward` (the "global token denominator",
docs/algorithms.md#global-denominator): after the call the model's main grads are d/dθ of the
SUM of the loss contributions that `loss_fn` returned, over every micro-batch and every
data-parallel rank. megatron would divide by the number of micro-batches and DDP would average
over data-parallel ranks; the model built by `relayrl.trainer.model.build_model` turns both off
(`calculate_per_token_loss`, with megatron's division by the loss functions' token count skipped
in `finalize_model_grads`), so a loss_fn that divides by a token count computed over the whole
global batch gets the right gradient whatever the micro-batch size and data-parallel size.

Only the positions a caller scores go through the output layer (`TokenBatch.first_scored_B`):
a prompt's positions have no use for a log-prob, and their logits cost a vocabulary-wide
projection each, and its gradient. Measured on SmolLM2-135M (vocabulary 49,152; 8 rows of a
100-token prompt and a 120-token response, micro-batches of 4, one core, 2026-12-07): the
forward-backward pass took 19.0 s instead of 22.7 s (median of two each); the forward pass
alone did not change beyond the noise (6.3 s against 6.5 s).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from relayrl.trainer.logprobs import chunked_token_logprobs

if TYPE_CHECKING:
    from relayrl.trainer.runtime import PolicyModel, PolicyOptimizer

# loss_fn(logp_bT, row_slice) -> (loss contribution, metrics)
LossFn = Callable[[torch.Tensor, slice], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TokenBatch:
    """Rows of token ids, each the prompt + response of one trajectory, right-padded with 0."""

    input_ids_BT: torch.Tensor
    """int64 [B, T] token ids; positions at or after a row's length are padding."""
    lengths_B: torch.Tensor
    """int64 [B] real length of each row, in [1, T]."""
    first_scored_B: torch.Tensor | None = None
    """int64 [B]: the first position of each row whose log-prob the caller uses (a response's
    first token; the row's length: none). Earlier positions get log-prob 0 and no logits are
    computed for them. None: every position from 1."""

    def __post_init__(self) -> None:
        ids, lengths, first = self.input_ids_BT, self.lengths_B, self.first_scored_B
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise ValueError(f"input_ids_BT must be int64 [B, T], got {ids.dtype} {ids.shape}")
        if lengths.shape != (ids.shape[0],) or lengths.dtype != torch.int64:
            raise ValueError(
                f"lengths_B must be int64 [{ids.shape[0]}], got {lengths.dtype} {lengths.shape}"
            )
        if ids.shape[0] and (lengths.min() < 1 or lengths.max() > ids.shape[1]):
            raise ValueError(f"lengths_B must lie in [1, T={ids.shape[1]}]")
        if first is not None and (first.shape != lengths.shape or first.dtype != torch.int64):
            raise ValueError(f"first_scored_B must be int64 [{ids.shape[0]}], got {first.shape}")

    @staticmethod
    def scoring(
        input_ids_BT: torch.Tensor, lengths_B: torch.Tensor, mask_BT: torch.Tensor
    ) -> TokenBatch:
        """Rows whose log-probs are used where `mask_BT` is nonzero (a response's tokens; mask 0
        on the prompt): scored from each row's first such position."""
        used_BT = mask_BT > 0
        first_B = torch.where(used_BT.any(dim=1), used_BT.int().argmax(dim=1), lengths_B)
        return TokenBatch(input_ids_BT, lengths_B, first_B.to(torch.int64))

    @property
    def num_rows(self) -> int:
        return self.input_ids_BT.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids_BT.shape[1]

    def token_mask_BT(self) -> torch.Tensor:
        """bool [B, T]: True at the positions that have a log-prob (1 <= t < length)."""
        t = torch.arange(self.seq_len)
        return (t >= 1) & (t < self.lengths_B.unsqueeze(1))


@dataclass(frozen=True)
class MicroBatch:
    rows: slice
    input_ids_bt: torch.Tensor  # trimmed to the longest row of the micro-batch
    lengths_b: torch.Tensor
    first_scored_b: torch.Tensor | None = None

    def scored(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row, position) of every token whose log-prob is used, when that is fewer than all
        of them; None: score every position (the output layer sees the whole micro-batch)."""
        if self.first_scored_b is None:
            return None
        t = torch.arange(1, self.input_ids_bt.shape[1])
        used_bt = (t >= self.first_scored_b.unsqueeze(1)) & (t < self.lengths_b.unsqueeze(1))
        rows, k = used_bt.nonzero(as_tuple=True)
        # none at all (rows that only pad a data-parallel shard): the whole pass, as before, so
        # that the loss stays connected to the parameters
        return (rows, k + 1) if rows.numel() else None


def micro_batches(
    batch: TokenBatch, micro_batch_size: int, max_tokens: int | None = None
) -> list[MicroBatch]:
    """Consecutive rows, at most `micro_batch_size` of them and, when `max_tokens` is set, at
    most `max_tokens` tokens counted as rows x the longest row (what the pass computes); a
    row longer than `max_tokens` goes alone. Activations grow with those tokens, so the token
    bound is what bounds the trainer's memory whatever the responses' lengths."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size {micro_batch_size} must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens {max_tokens} must be >= 1")
    lengths = batch.lengths_B.tolist()
    out = []
    start = 0
    while start < batch.num_rows:
        end, width = start + 1, lengths[start]
        while end < batch.num_rows and end - start < micro_batch_size:
            wider = max(width, lengths[end])
            if max_tokens is not None and (end - start + 1) * wider > max_tokens:
                break
            end, width = end + 1, wider
        # Causal attention: trailing padding changes nothing before it, so it is not computed.
        rows = slice(start, end)
        first = None if batch.first_scored_B is None else batch.first_scored_B[rows]
        ids = batch.input_ids_BT[rows, :width].contiguous()
        out.append(MicroBatch(rows, ids, batch.lengths_B[rows], first))
        start = end
    return out


def _causal_mask(seq_len: int) -> torch.Tensor:
    # megatron's default causal mask is built on "cuda" by a cached helper; an explicit
    # boolean mask (True = masked out) works on every device.
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forward_step(
    data_iterator: Iterator[MicroBatch],
    model: torch.nn.Module,
    *,
    seq_len: int,
    temperature: float,
    loss_fn: LossFn | None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    micro = next(data_iterator)
    device = _device(model)
    ids = micro.input_ids_bt.to(device)
    width = ids.shape[1]
    position_ids = torch.arange(width, device=device).unsqueeze(0).expand_as(ids)
    scored = micro.scored()
    with _only_positions(model, scored):
        logits = model(ids, position_ids, _causal_mask(width).to(device))
    return logits, partial(
        _loss_func,
        micro=micro,
        scored=scored,
        seq_len=seq_len,
        temperature=temperature,
        loss_fn=loss_fn,
    )


@contextlib.contextmanager
def _only_positions(
    model: torch.nn.Module, scored: tuple[torch.Tensor, torch.Tensor] | None
) -> Iterator[None]:
    """While the model runs: its output layer sees only the hidden states that score `scored`'s
    tokens (position t - 1 scores the token at t), as [n, 1, hidden], so the model returns
    logits [1, n, vocab]. Autograd records the selection; backward needs no hook."""
    if scored is None:
        yield
        return
    rows, positions = scored

    def select(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden_sbh = args[0]  # megatron's [sequence, batch, hidden]
        picked = hidden_sbh[positions.to(hidden_sbh.device) - 1, rows.to(hidden_sbh.device)]
        return (picked.unsqueeze(1), *args[1:]), kwargs

    from relayrl.trainer.model import unwrap_model  # imports megatron: not on this module's import

    handle = unwrap_model(model).output_layer.register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def token_logprobs(
    logits_btv: torch.Tensor,
    input_ids_bt: torch.Tensor,
    lengths_b: torch.Tensor,
    seq_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """float32 [b, seq_len]: log-prob of token t under `logits[t-1] / temperature` for
    1 <= t < length, 0 elsewhere. `logits_btv` is this rank's vocabulary shard (tensor
    parallel); the softmax is reduced over the TP group, in chunks of tokens
    (`relayrl.trainer.logprobs`: no full-size copy of the logits is kept for backward, whose
    gradient overwrites them)."""
    b, width = input_ids_bt.shape
    if width < 2:
        return torch.zeros(b, seq_len, device=logits_btv.device)
    # logits at t score the token at t + 1; the last position scores nothing (target 0, masked)
    targets_bt = F.pad(input_ids_bt[:, 1:], (0, 1)).to(logits_btv.device)
    logp_bt = chunked_token_logprobs(logits_btv, targets_bt, temperature)[:, :-1]
    t = torch.arange(1, width, device=logp_bt.device)
    valid_bt = t < lengths_b.to(logp_bt.device).unsqueeze(1)
    logp_bt = torch.where(valid_bt, logp_bt, torch.zeros_like(logp_bt))
    # Position 0 has no log-prob; positions past this micro-batch's width are padding.
    return F.pad(logp_bt, (1, seq_len - width))


def scored_logprobs(
    logits_1nv: torch.Tensor,
    input_ids_bt: torch.Tensor,
    scored: tuple[torch.Tensor, torch.Tensor],
    seq_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """float32 [b, seq_len]: as `token_logprobs`, from the logits of the `scored` (row,
    position) tokens only (`_only_positions`), 0 at every other position."""
    rows, positions = scored
    device = logits_1nv.device
    rows, positions = rows.to(device), positions.to(device)
    targets_1n = input_ids_bt.to(device)[rows, positions].unsqueeze(0)
    logp_n = chunked_token_logprobs(logits_1nv, targets_1n, temperature)[0]
    logp_bt = torch.zeros(input_ids_bt.shape[0], seq_len, dtype=logp_n.dtype, device=device)
    return logp_bt.index_put((rows, positions), logp_n)


def _loss_func(
    logits: torch.Tensor,
    *,
    micro: MicroBatch,
    scored: tuple[torch.Tensor, torch.Tensor] | None,
    seq_len: int,
    temperature: float,
    loss_fn: LossFn | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    if scored is None:
        ids, lengths = micro.input_ids_bt, micro.lengths_b
        logp_bt = token_logprobs(logits, ids, lengths, seq_len, temperature)
    else:
        logp_bt = scored_logprobs(logits, micro.input_ids_bt, scored, seq_len, temperature)
    num_tokens = (micro.lengths_b - 1).clamp(min=0).sum().to(torch.int)
    if loss_fn is None:
        # forward only: the "loss" is unused; the log-probs travel in the data store.
        return logp_bt.sum() * 0.0, num_tokens, {"rows": micro.rows, "logp": logp_bt}
    loss, metrics = loss_fn(logp_bt, micro.rows)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
    # A 3-tuple with calculate_per_token_loss: megatron neither divides by the number of
    # micro-batches nor by num_tokens (see the module docstring).
    return loss, num_tokens, metrics


def _run_schedule(
    model: PolicyModel,
    batch: TokenBatch,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int | None,
    temperature: float,
    loss_fn: LossFn | None,
) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not temperature > 0:
        raise ValueError(f"temperature {temperature} must be positive")
    config = model.config if hasattr(model, "config") else None
    if config is None or not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "the model must come from relayrl.trainer.model.build_model "
            "(calculate_per_token_loss keeps the gradient a plain sum)"
        )
    micros = micro_batches(batch, micro_batch_size, micro_batch_tokens)
    if not micros:
        return []
    forward_backward_func = get_forward_backward_func()
    return forward_backward_func(
        forward_step_func=partial(
            _forward_step, seq_len=batch.seq_len, temperature=temperature, loss_fn=loss_fn
        ),
        data_iterator=iter(micros),
        model=[model],
        num_microbatches=len(micros),
        seq_length=batch.seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=loss_fn is None,
    )


def forward_logprobs(
    model: PolicyModel,
    batch: TokenBatch,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """float32 [B, T]: `logp[b, t] = log softmax(logits[b, t-1] / temperature)[ids[b, t]]` for
    1 <= t < lengths[b], 0 elsewhere; forward only, no gradients. Under tensor parallelism
    every TP rank passes the same batch and gets the same result; under data parallelism each
    rank passes its own rows and gets theirs."""
    if batch.num_rows == 0:
        return torch.zeros(0, batch.seq_len)
    with torch.no_grad():
        store = _run_schedule(
            model,
            batch,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            temperature=temperature,
            loss_fn=None,
        )
    logp_BT = torch.zeros(batch.num_rows, batch.seq_len)
    for item in store:
        logp_BT[item["rows"]] = item["logp"].float().cpu()
    return logp_BT


def forward_backward(
    model: PolicyModel,
    batch: TokenBatch,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    temperature: float,
    loss_fn: LossFn,
) -> list[dict[str, float]]:
    """One forward-backward pass over `batch` in micro-batches of at most `micro_batch_size`
    rows and `micro_batch_tokens` tokens (`micro_batches`).

    `loss_fn(logp_bT, row_slice)` is called once per micro-batch with the log-probs (float32,
    with gradient, [rows, T] laid out as in `forward_logprobs`) of `batch`'s rows
    `row_slice`, and returns `(loss contribution: scalar tensor, metrics)`.

    Zeroes the model's gradient buffers (and drops `param.grad`) first, so the caller need
    not: megatron's data-parallel reduction runs inside each call, so gradients cannot be
    accumulated across calls (put every micro-batch of an optimizer step into one call).
    Afterwards `param.main_grad` holds d/dθ of the sum of all loss contributions over
    micro-batches and data-parallel ranks (module docstring); `optimizer_step` applies it.
    Returns each micro-batch's metrics, in order.
    """
    model.zero_grad_buffer()
    # megatron's optimizers point `param.grad` at `param.main_grad` for their step; left in
    # place, autograd would accumulate into that alias and DDP's hook would add it to
    # main_grad a second time (gradients doubled, tied embeddings worse).
    for param in model.parameters():
        param.grad = None
    if batch.num_rows == 0:
        raise ValueError("forward_backward needs at least one row on every rank")
    return _run_schedule(
        model,
        batch,
        micro_batch_size=micro_batch_size,
        micro_batch_tokens=micro_batch_tokens,
        temperature=temperature,
        loss_fn=loss_fn,
    )


def optimizer_step(optimizer: PolicyOptimizer) -> tuple[bool, float]:
    """Clip, step and report: (update applied, global gradient L2 norm before clipping).

    An update is skipped (False) only when fp16 loss scaling finds inf/nan; the norm is
    computed even when clipping is off. Collective over the model-parallel and (distributed
    optimizer) data-parallel groups.
    """
    success, grad_norm, _num_zeros = optimizer.step()
    if grad_norm is None:
        grad_norm = optimizer.get_grad_norm() if success else math.nan
    # Drop the `param.grad = param.main_grad` aliases the step created (see forward_backward).
    optimizer.zero_grad()
    return bool(success), float(grad_norm)
