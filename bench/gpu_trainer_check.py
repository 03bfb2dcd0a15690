"""The trainer's step on one GPU against bare PyTorch on the same GPU: SmolLM2-135M-Instruct in
bf16, one prepared check that needs torch, megatron-core, transformers and relayrl only (no
vLLM, no engine, no services).

    python bench/gpu_trainer_check.py [--rows 32] [--min-len 192] [--max-len 512]

Both sides run the three phases of a step over the same rows (random lengths in
[min-len, max-len], split into the same micro-batches, each padded to its longest row):
    old logprobs   one no-grad forward pass, log-probs of every token
    fwd+bwd        one forward and backward pass of a policy-gradient loss over the tokens
    optimizer      one Adam step
relayrl: megatron-core's GPTModel and optimizer through relayrl.trainer (forward_logprobs,
forward_backward, optimizer_step), as the trainer runs them. Reference: transformers' model in
bf16 with torch.optim.AdamW (fused), the same log-prob expression in plain autograd.

MFU counts 2 x parameters FLOPs per token for a forward pass and 6 x for forward plus
backward (attention's share is left out, so it errs low), over the device's dense bf16 peak.

It prints the phase table and ends with exactly
    gpu-trainer-check: trainer_vs_torch=<r> mfu=<m> torch_mfu=<m> ok=<bool>
where trainer_vs_torch = reference seconds / relayrl seconds (target >= 0.9, issue 34); ok is
whether both sides ran and gave finite times and matching log-probs. Exits 1 when ok is false.
tests/gpu/test_gpu_trainer_check.py runs it (marked `gpu`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

# dense bf16 peak FLOP/s by device name (NVIDIA's data sheets, SXM parts)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
# bf16 on both sides, 30 layers, rounded at different points (megatron keeps the norms' weights
# in fp32): a token's log-prob differs by 0.07 on average and 0.31 at worst on CPU. A wrong
# weight mapping or mask differs by whole nats.
LOGP_MAX_TOL, LOGP_MEAN_TOL = 2.0, 0.2


def peak_flops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def make_rows(args: argparse.Namespace) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randint(args.min_len, args.max_len) for _ in range(args.rows)]


def token_ids(lengths: list[int], vocab: int):  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
    return ids


def timed(fn):  # type: ignore[no-untyped-def]
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - started


def relayrl_side(rank: int, world_size: int, hf_dir: Path, lengths: list[int], args):  # type: ignore[no-untyped-def]
    import torch

    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.forward import (
        TokenBatch,
        forward_backward,
        forward_logprobs,
        optimizer_step,
    )
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, build_optimizer, init_parallel, load_hf_dir

    init_parallel(tensor_model_parallel_size=1, seed=0)
    spec = ModelSpec.from_hf_dir(hf_dir)
    model = build_model(spec, params_dtype=torch.bfloat16)
    load_hf_dir(model, hf_dir)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-6, clip_grad=1.0))
    batch = TokenBatch(token_ids(lengths, spec.vocab_size), torch.tensor(lengths))
    num_tokens = sum(n - 1 for n in lengths)

    def loss_fn(logp_bT, rows):  # type: ignore[no-untyped-def]
        return -(logp_bT.sum()) / num_tokens, {}

    def step() -> dict[str, float]:
        kw = {"micro_batch_size": args.micro_batch_size, "micro_batch_tokens": args.micro_tokens}
        _, old = timed(lambda: forward_logprobs(model, batch, **kw))
        _, fb = timed(
            lambda: forward_backward(model, batch, temperature=1.0, loss_fn=loss_fn, **kw)
        )
        _, opt = timed(lambda: optimizer_step(optimizer))
        return {"old_logprobs": old, "fwd_bwd": fb, "optimizer": opt}

    logp = forward_logprobs(model, batch, micro_batch_size=args.micro_batch_size)
    step()  # warm-up: kernels, allocator, Adam's state
    runs = [step() for _ in range(args.repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}, logp.cpu()


def torch_side(hf_dir: Path, lengths: list[int], args):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    from relayrl.trainer.forward import TokenBatch, micro_batches

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device)
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=device == "cuda")
    batch = TokenBatch(token_ids(lengths, hf.config.vocab_size), torch.tensor(lengths))
    parts = [
        m.input_ids_bt.to(device)
        for m in micro_batches(batch, args.micro_batch_size, args.micro_tokens)
    ]
    num_tokens = sum(n - 1 for n in lengths)

    def logp(ids):  # type: ignore[no-untyped-def]
        logits = hf(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def old() -> list:
        with torch.no_grad():
            return [logp(ids) for ids in parts]

    def fwd_bwd() -> None:
        for ids in parts:
            (-logp(ids).sum() / num_tokens).backward()

    def opt() -> None:
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    def step() -> dict[str, float]:
        return {"old_logprobs": timed(old)[1], "fwd_bwd": timed(fwd_bwd)[1],
                "optimizer": timed(opt)[1]}  # fmt: skip

    first = [x.cpu() for x in old()]
    step()
    runs = [step() for _ in range(args.repeats)]
    n_params = sum(p.numel() for p in hf.parameters())
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}, first, n_params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=192)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--micro-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU: run the code paths on the CPU"
    )
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu-trainer-check: no CUDA device", file=sys.stderr)
        return 2
    from relayrl.trainer.model import spawn_ranks
    from relayrl_testkit.helpers.real_model import smollm2_dir

    hf_dir = smollm2_dir("bf16")
    lengths = make_rows(args)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(
        f"{device}: SmolLM2-135M-Instruct bf16, {len(lengths)} rows of {min(lengths)} to "
        f"{max(lengths)} tokens, micro-batches of {args.micro_batch_size} rows",
        flush=True,
    )
    ((ours, ours_logp),) = spawn_ranks(relayrl_side, 1, hf_dir, lengths, args, timeout_s=1200)
    theirs, their_logp, n_params = torch_side(hf_dir, lengths, args)

    # the same log-probs: position t of relayrl's row is token t scored by position t - 1
    diffs, row = [], 0
    for part in their_logp:
        for r in range(part.shape[0]):
            n = lengths[row]
            diffs.append((ours_logp[row, 1:n] - part[r, : n - 1]).abs())
            row += 1
    every = torch.cat(diffs)
    worst, mean = float(every.max()), float(every.mean())
    tokens = sum(lengths)
    flops = {"old_logprobs": 2 * n_params * tokens, "fwd_bwd": 6 * n_params * tokens}
    peak = peak_flops(device)
    print(f"{'phase':<14}{'relayrl s':>11}{'torch s':>11}{'ratio':>8}")
    for phase in ours:
        print(f"{phase:<14}{ours[phase]:>11.4f}{theirs[phase]:>11.4f}"
              f"{theirs[phase] / ours[phase]:>8.2f}")  # fmt: skip
    ours_s, theirs_s = sum(ours.values()), sum(theirs.values())
    work = sum(flops.values())
    mfu = work / ours_s / peak if peak else math.nan
    torch_mfu = work / theirs_s / peak if peak else math.nan
    print(
        f"log-probs |relayrl - torch|: max {worst:.4f} (tolerance {LOGP_MAX_TOL}), mean "
        f"{mean:.4f} (tolerance {LOGP_MEAN_TOL})"
    )
    finite = all(math.isfinite(v) for v in (*ours.values(), *theirs.values()))
    ok = finite and worst <= LOGP_MAX_TOL and mean <= LOGP_MEAN_TOL
    print(
        f"gpu-trainer-check: trainer_vs_torch={theirs_s / ours_s:.2f} mfu={mfu:.3f} "
        f"torch_mfu={torch_mfu:.3f} ok={str(ok).lower()}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
