"""The trainer's chunked token log-probs equal the plain autograd expression (value and
gradient) within fp32 rounding, and micro-batches respect both their row and token bounds."""

from __future__ import annotations

import pytest
import torch

from relayrl.trainer.forward import TokenBatch, micro_batches, token_logprobs
from relayrl.trainer.logprobs import chunked_token_logprobs


def plain(logits_btv: torch.Tensor, targets_bt: torch.Tensor, temperature: float) -> torch.Tensor:
    logp_btv = torch.log_softmax(logits_btv.float() / temperature, dim=-1)
    return logp_btv.gather(-1, targets_bt.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    ("dtype", "temperature", "chunk", "tol"),
    [
        (torch.float32, 1.0, 5, 1e-5),
        (torch.float32, 0.7, 256, 1e-5),  # one chunk holds every token
        (torch.float32, 1.3, 1, 1e-5),  # a chunk per token
        (torch.bfloat16, 1.0, 4, 1e-2),  # the gradient is rounded to bf16
    ],
)
def test_chunked_logprobs_and_gradient_equal_the_plain_expression(
    dtype: torch.dtype, temperature: float, chunk: int, tol: float
) -> None:
    gen = torch.Generator().manual_seed(0)
    b, t, v = 3, 7, 97
    base = (torch.randn(b, t, v, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=gen)
    upstream = torch.randn(b, t, generator=gen)

    reference_logits = base.clone().requires_grad_(True)
    expected = plain(reference_logits, targets, temperature)
    (expected * upstream).sum().backward()

    # the backward pass overwrites its input with the gradient: give it a tensor of its own,
    # behind an op whose backward does not read it, as the output layer's is
    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1
    got = chunked_token_logprobs(logits, targets, temperature, chunk_tokens=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-5)
    (got * upstream).sum().backward()
    assert leaf.grad is not None and reference_logits.grad is not None
    torch.testing.assert_close(leaf.grad.float(), reference_logits.grad.float(), rtol=0, atol=tol)


def test_chunked_logprobs_refuse_what_they_cannot_compute() -> None:
    logits = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="temperature 0"):
        chunked_token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_token_logprobs(logits, torch.zeros(2, 2, dtype=torch.long))


def test_token_logprobs_score_each_token_by_the_previous_position_and_mask_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([[5, 1, 2, 3], [4, 2, 0, 0]])
    lengths = torch.tensor([4, 2])
    logits = torch.randn(2, 4, 6, generator=gen)
    got = token_logprobs(logits, ids, lengths, seq_len=6, temperature=0.5)
    assert got.shape == (2, 6)
    full = torch.log_softmax(logits / 0.5, dim=-1)
    assert got[0, 0] == 0 and got[1, 0] == 0  # position 0 has no previous token
    for t in range(1, 4):
        assert got[0, t] == pytest.approx(float(full[0, t - 1, ids[0, t]]), abs=1e-5)
    assert got[1, 1] == pytest.approx(float(full[1, 0, ids[1, 1]]), abs=1e-5)
    assert got[1, 2:].abs().sum() == 0 and got[0, 4:].abs().sum() == 0  # padding


def batch_of(lengths: list[int]) -> TokenBatch:
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    return TokenBatch(ids, torch.tensor(lengths))


def shapes(lengths: list[int], rows: int, tokens: int | None) -> list[tuple[int, int]]:
    return [tuple(m.input_ids_bt.shape) for m in micro_batches(batch_of(lengths), rows, tokens)]


def test_micro_batches_are_padded_to_their_own_longest_row() -> None:
    assert shapes([3, 9, 2, 4], rows=2, tokens=None) == [(2, 9), (2, 4)]


def test_micro_batches_keep_rows_times_their_longest_row_within_the_token_bound() -> None:
    # rows x longest row <= 10: [3, 3, 3] is 9; adding 4 would make 4 x 4 = 16
    assert shapes([3, 3, 3, 4, 2], rows=8, tokens=10) == [(3, 3), (2, 4)]
    # a row longer than the bound goes alone, and the rows after it start a new micro-batch
    assert shapes([2, 12, 2, 2], rows=8, tokens=10) == [(1, 2), (1, 12), (2, 2)]
    # the row bound still holds when the tokens would allow more
    assert shapes([1] * 5, rows=2, tokens=100) == [(2, 1), (2, 1), (1, 1)]
    # every row lands in exactly one micro-batch, in order
    micro = micro_batches(batch_of([5, 1, 7, 3, 3, 8]), 3, 9)
    assert [r for m in micro for r in range(m.rows.start, m.rows.stop)] == list(range(6))
    assert all(m.input_ids_bt.numel() <= 9 or m.input_ids_bt.shape[0] == 1 for m in micro)


def test_micro_batch_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="micro_batch_size 0"):
        micro_batches(batch_of([2]), 0)
    with pytest.raises(ValueError, match="max_tokens 0"):
        micro_batches(batch_of([2]), 1, 0)
