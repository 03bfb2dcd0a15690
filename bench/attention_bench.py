"""The trainer's attention: megatron's eager `DotProductAttention` against the fused causal
attention the trainer builds (relayrl.trainer.attention), side by side in one process on one
core, over the same weights and rows: a forward-backward pass (`forward_backward`, the loss on
each row's response) per shape, each timed `--repeats` times, the median kept.

Shapes: the tiny Qwen2 (`relayrl model init`, what `relayrl up` trains by default)
    short   64 rows of a 40-token prompt and a 24-token answer: an arith warm-start batch
    tool    64 rows of a 550-token prompt and a 50-token answer: a lookup warm-start batch
            (the tools' system prompt), one micro-batch each

The last line is exactly:
    attention-bench: short_ratio=<eager s / fused s> tool_ratio=<eager s / fused s>
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES = {"short": (64, 40, 24), "tool": (64, 550, 50)}  # rows, prompt tokens, answer tokens


def rank(rank: int, world_size: int, model_dir: Path, repeats: int) -> dict[str, Any]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    import relayrl.trainer.attention as attention
    from relayrl.trainer.forward import TokenBatch, forward_backward
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir

    torch.set_num_threads(1)
    init_parallel(tensor_model_parallel_size=1, seed=0)
    fused = attention.FusedCausalAttention
    models = {}
    for name, core in (("eager", DotProductAttention), ("fused", fused)):
        attention.FusedCausalAttention = core  # what build_model puts in the layer spec
        models[name] = build_model(ModelSpec.from_hf_dir(model_dir))
        load_hf_dir(models[name], model_dir)
    attention.FusedCausalAttention = fused
    generator = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for shape, (rows, prompt, answer) in SHAPES.items():
        ids = torch.randint(1, 500, (rows, prompt + answer), generator=generator)
        lengths = torch.full((rows,), prompt + answer)
        mask = torch.zeros(rows, prompt + answer)
        mask[:, prompt:] = 1
        batch = TokenBatch.scoring(ids, lengths, mask)

        def loss(logp: torch.Tensor, part: slice) -> tuple[torch.Tensor, dict[str, float]]:
            return -(logp * mask[part]).sum() / float(mask.sum()), {}  # noqa: B023

        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(repeats):  # interleaved, so that a noisy moment hits both
            for name, model in models.items():
                start = time.perf_counter()
                forward_backward(model, batch, micro_batch_size=rows, temperature=1.0, loss_fn=loss)
                times[name].append(time.perf_counter() - start)
        out[shape] = {name: statistics.median(t) for name, t in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from relayrl.trainer.model import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="attention-bench-") as tmp:
        model_dir = Path(tmp) / "tiny"
        init = [sys.executable, "-m", "relayrl.cli", "model", "init", str(model_dir)]
        subprocess.run(init, check=True, capture_output=True, timeout=300)
        result = spawn_ranks(rank, 1, model_dir, args.repeats, timeout_s=1800)[0]
    print(f"{'shape':<8}{'rows x tokens':>15}{'eager s':>10}{'fused s':>10}{'ratio':>8}")
    ratios = {}
    for shape, (rows, prompt, answer) in SHAPES.items():
        eager, fused = result[shape]["eager"], result[shape]["fused"]
        ratios[shape] = eager / fused
        size = f"{rows} x {prompt + answer}"
        print(f"{shape:<8}{size:>15}{eager:>10.2f}{fused:>10.2f}{ratios[shape]:>8.2f}")
    print(f"attention-bench: short_ratio={ratios['short']:.2f} tool_ratio={ratios['tool']:.2f}")


if __name__ == "__main__":
    main()
