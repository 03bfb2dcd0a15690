"""Train/inference mismatch with identical weights: the log-probs a real vLLM engine reports
for the tokens it sampled (μ) against the trainer's recomputation of the same tokens (π_old:
relayrl's megatron model, fp32 on CPU, `forward_logprobs`), on the tiny model and on
SmolLM2-135M-Instruct. Engine rows:
    fp32      the engine computes in fp32 with the weights it loaded from the model folder
    fp32+ws   the same engine after weight-sync delivered the trainer's weights (bf16 on the
              wire, as every version after the first reaches the engine in the pipeline)
    bf16      the engine computes in bf16
    bf16+fp8  the bf16 engine after weight-sync delivered FP8 block-128 weights (embeddings
              in bf16, the default)

Per row, over every sampled response token (temperature 1):
    mean, p99, max   of |log π_old - log μ| (nats)
    <0.1, mid, >0.9  the mean of it over tokens the engine sampled with probability below 0.1,
                     between 0.1 and 0.9, and above 0.9 (token count in brackets)
    ratio            the range of token ratios π_old/μ
    seq ratio        the range of sequence ratios, exp Σ_t log(π_old/μ)

The last line is exactly (bf16: SmolLM2 where it ran, else tiny; fp8 likewise):
    mismatch-bench: bf16_mean=<x> bf16_p99=<y> fp8_mean=<z>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from fp8_bench import PROMPTS as FP8_PROMPTS

PROMPTS = FP8_PROMPTS[:8]  # eight of bench-fp8's short chat prompts


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    engine_logprobs: list[float]


@dataclass
class Row:
    model: str
    engine: str
    tokens: int
    mean: float
    p99: float
    max: float
    bins: list[tuple[float, int]]  # (mean |dlogp|, tokens) for p < 0.1, 0.1-0.9, > 0.9
    ratio: tuple[float, float]
    seq_ratio: tuple[float, float]


def prompts_for(name: str, model_dir: Path) -> list[list[int]]:
    if name == "tiny":  # no chat template: token ids drawn from the vocabulary
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(3, 250, (8,), generator=generator).tolist() for _ in PROMPTS]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def sample(url: str, prompts: list[list[int]], per_prompt: int, max_tokens: int) -> list[Sample]:
    from relayrl.inference.client import GenerateRequest, SamplingOptions, VllmEngineClient

    async def main() -> list[Sample]:
        client = VllmEngineClient(url)
        try:
            requests = [
                GenerateRequest(
                    f"mismatch-{i}-{j}",
                    tuple(prompt),
                    SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=1000 * i + j),
                )
                for i, prompt in enumerate(prompts)
                for j in range(per_prompt)
            ]
            generations = await asyncio.gather(*(client.generate(r) for r in requests))
        finally:
            await client.close()
        return [
            Sample(list(r.prompt_token_ids), list(g.token_ids), list(g.logprobs))
            for r, g in zip(requests, generations, strict=True)
        ]

    return asyncio.run(main())


def trainer_logprobs(model: torch.nn.Module, samples: list[Sample]) -> list[list[float]]:
    """π_old as the trainer computes it: one no-grad forward of prompt + response."""
    from relayrl.trainer.forward import TokenBatch, forward_logprobs

    rows = [s.prompt + s.response for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    logp = forward_logprobs(model, TokenBatch(ids, lengths), micro_batch_size=8, temperature=1.0)
    return [
        logp[i, len(s.prompt) : len(s.prompt) + len(s.response)].tolist()
        for i, s in enumerate(samples)
    ]


def compare(model: str, engine: str, samples: list[Sample], old: list[list[float]]) -> Row:
    log_r = [
        torch.tensor(o, dtype=torch.float64) - torch.tensor(s.engine_logprobs, dtype=torch.float64)
        for s, o in zip(samples, old, strict=True)
    ]
    tokens = torch.cat(log_r)
    mu = torch.cat([torch.tensor(s.engine_logprobs, dtype=torch.float64) for s in samples]).exp()
    gap = tokens.abs()
    bins = []
    for low, high in ((0.0, 0.1), (0.1, 0.9), (0.9, 1.01)):
        inside = (mu >= low) & (mu < high)
        count = int(inside.sum())
        bins.append((float(gap[inside].mean()) if count else float("nan"), count))
    seq = torch.stack([r.sum() for r in log_r]).exp()
    ratio = tokens.exp()
    return Row(
        model=model,
        engine=engine,
        tokens=int(tokens.numel()),
        mean=float(gap.mean()),
        p99=float(torch.quantile(gap, 0.99)),
        max=float(gap.max()),
        bins=bins,
        ratio=(float(ratio.min()), float(ratio.max())),
        seq_ratio=(float(seq.min()), float(seq.max())),
    )


def build_trainer_model(model_dir: Path) -> torch.nn.Module:
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_parallel(tensor_model_parallel_size=1, seed=0)
    model = build_model(ModelSpec.from_hf_dir(model_dir))
    load_hf_dir(model, model_dir)
    model.eval()
    return model


def push(
    model: torch.nn.Module, model_dir: Path, engine_url: str, quantization: str, work: Path
) -> None:
    """The trainer's weights through a real weight-sync into the engine, as the pipeline
    delivers every version after the first: bf16 on the wire (`none`) or FP8 block-128."""
    from relayrl.core.service_process import ServiceProcess
    from relayrl.trainer.hf_mapping import ModelSpec, export_hf_tensors
    from relayrl.weightsync.sender import WeightSyncSender

    config = {"engines": {"urls": [engine_url]}, "transfer_timeout_s": 600}
    with ServiceProcess("relayrl-weightsync", config, work / "weightsync") as weightsync:
        sender = WeightSyncSender(weightsync.target, timeout_s=600, quantization=quantization)
        try:
            tensors = list(export_hf_tensors(model, ModelSpec.from_hf_dir(model_dir)))
            result = sender.publish(1, 1, tensors)
            sender.wait_committed(result.transfer_id, 600)
        finally:
            sender.close()


def measure(name: str, model_dir: Path, args: argparse.Namespace, work: Path) -> list[Row]:
    from relayrl_testkit.helpers.engines import start_engine

    model = build_trainer_model(model_dir)
    prompts = prompts_for(name, model_dir)
    rows = []
    for dtype in ("float32", "bfloat16"):
        engine = start_engine(
            model_dir, work / f"{name}-{dtype}", dtype=dtype, max_model_len=1024, seed=0
        )
        try:
            label = "fp32" if dtype == "float32" else "bf16"
            pushed = "none" if dtype == "float32" else "fp8_block_128"
            for variant in (label, f"{label}+{'ws' if pushed == 'none' else 'fp8'}"):
                if variant != label:
                    push(model, model_dir, engine.url, pushed, work / f"{name}-{variant}")
                samples = sample(engine.url, prompts, args.per_prompt, args.max_tokens)
                rows.append(compare(name, variant, samples, trainer_logprobs(model, samples)))
        finally:
            engine.stop()
        print(f"  {name} {dtype} done", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-prompt", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    parser.add_argument(
        "--tiny-dir",
        type=Path,
        help="the tiny model to use (e.g. a relayrl up warm start); default: a fresh one",
    )
    parser.add_argument("--no-smollm2", action="store_true", help="the tiny model only")
    parser.add_argument("--work", type=Path, default=Path("runs/mismatch-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from relayrl.models.tiny import TinyModelConfig, init_model

    tiny = args.tiny_dir or args.work / "tiny"
    if not (tiny / "config.json").exists():
        init_model(tiny, TinyModelConfig())
    rows = measure("tiny", tiny, args, args.work)
    if not args.no_smollm2:
        from relayrl_testkit.helpers.real_model import smollm2_dir

        rows += measure("smollm2", smollm2_dir("fp32"), args, args.work)
    print(
        f"{'model':<8} {'engine':<9} {'tokens':>6} {'mean':>7} {'p99':>7} {'max':>7} "
        f"{'<0.1':>13} {'0.1-0.9':>13} {'>0.9':>13} {'ratio':>15} {'seq ratio':>17}"
    )
    for r in rows:
        bins = " ".join(f"{m:>7.4f} [{n:>4}]" for m, n in r.bins)
        print(
            f"{r.model:<8} {r.engine:<9} {r.tokens:>6} {r.mean:>7.4f} {r.p99:>7.4f} "
            f"{r.max:>7.4f} {bins} [{r.ratio[0]:.3f}, {r.ratio[1]:.3f}] "
            f"[{r.seq_ratio[0]:.3f}, {r.seq_ratio[1]:.3f}]"
        )
    headline = "tiny" if args.no_smollm2 else "smollm2"
    bf16 = next(r for r in rows if r.model == headline and r.engine == "bf16")
    fp8 = next(r for r in rows if r.model == headline and r.engine == "bf16+fp8")
    print(f"(headline model: {headline}; the trainer computes in fp32)")
    print(
        f"mismatch-bench: bf16_mean={bf16.mean:.4f} bf16_p99={bf16.p99:.4f} fp8_mean={fp8.mean:.4f}"
    )


if __name__ == "__main__":
    main()
