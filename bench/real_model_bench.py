"""SmolLM2-135M-Instruct, a real pretrained model, on a reasoning-gym task through the real stack
(`relayrl up --model ... --task reasoning_gym:...`): time per phase, engine and trainer
tokens/s, and, side by side in the same run, plain transformers on the same shapes, so the
trainer's cost over the bare model is a ratio.

The run is in `sync` mode, so a step's phases do not overlap and each is measured alone:
    generation   the trainer's wait for its scored groups, less the reward phase
    reward       the last trajectory's finish to its group's last score (reward_timing.jsonl)
    old logprobs the trainer's no-grad forward over the batch
    update       forward + backward + optimizer step
    weight sync  export, push and commit on the engine (the trainer's publish phase)
Engine tokens/s is generated tokens over generation time; trainer tokens/s is every token of
the batch (prompt + response) over old logprobs + update. The transformers reference runs
one no-grad forward and one forward+backward on a batch of the same shape (rows, prompt and
response lengths as the run's mean), in fp32 on CPU like the trainer, on the same threads.

The last line is exactly:
    real-model-bench: trainer_tok_s=<x> engine_tok_s=<y> sync_s=<z> trainer_vs_hf=<ratio>
where trainer_vs_hf is (old logprobs + update) ÷ (transformers forward + forward/backward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

DATASET = "basic_arithmetic"
OPTIONS = {
    "max_terms": 2, "max_digits": 2, "operators": ["+", "-"], "allow_parentheses": False,
    "allow_negation": False,
}  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def up_config(args: argparse.Namespace) -> dict:
    return {
        "task": {"options": OPTIONS, "train_prompts": 400, "heldout_prompts": args.heldout},
        "train": {
            "mode": "sync", "steps": args.steps, "batch_groups": args.batch_groups,
            "samples_per_prompt": args.samples, "max_tokens": args.max_tokens,
            "micro_batch_size": args.batch_groups * args.samples, "lr": args.lr,
            "lr_schedule": "constant", "min_lr": 0.0, "checkpoint_interval_steps": args.steps,
        },
        "eval": {"interval_steps": 0, "sampled": False},
        "engine": {"max_model_len": 1024, "max_num_seqs": 32},
        "services": {"trainer": {"algorithm": {"dapo_filter": False}}},
    }  # fmt: skip


def run_up(model: Path, args: argparse.Namespace, workdir: Path) -> Path:
    config = workdir / "bench.yaml"
    config.write_text(yaml.safe_dump(up_config(args)))
    argv = [
        str(Path(sys.executable).parent / "relayrl"), "up", "--model", str(model),
        "--task", f"reasoning_gym:{args.dataset}", "--config", str(config),
        "--runs-dir", str(workdir / "runs"),
    ]  # fmt: skip
    log_path = workdir / "up.log"
    print(f"relayrl up on SmolLM2, {args.steps} sync steps (log: {log_path})", flush=True)
    started = time.monotonic()
    with log_path.open("wb") as log:
        code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
    output = log_path.read_text(errors="replace")
    if code != 0:
        sys.exit(f"real-model-bench: relayrl up exited {code}:\n{output[-3000:]}")
    print(f"  done in {time.monotonic() - started:.0f} s", flush=True)
    print("  " + output.strip().splitlines()[-1], flush=True)  # relayrl up's own summary
    line = next(x for x in output.splitlines() if x.startswith("relayrl up: run "))
    return Path(line.rsplit(" ", 1)[-1])


def mean_prompt_tokens(run_dir: Path, model: Path) -> float:
    """Mean prompt length of the run's training prompts, rendered as the gateway does."""
    from transformers import AutoTokenizer

    from relayrl.conversation.rendering import render

    tokenizer = AutoTokenizer.from_pretrained(model)
    records = read_jsonl(run_dir / "data" / "prompts.jsonl")[:200]
    lengths = [
        len(tokenizer.encode(render(tokenizer, r["messages"], None, True),
                             add_special_tokens=False))
        for r in records
    ]  # fmt: skip
    return statistics.fmean(lengths)


def transformers_reference(
    model: Path, rows: int, length: int, repeats: int
) -> tuple[float, float]:
    """Median seconds of one no-grad forward and of one forward+backward on `rows` x `length`
    tokens, plain transformers, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.train()
    ids = torch.randint(
        3, hf.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0)
    )
    forward, backward = [], []
    for _ in range(repeats + 1):  # the first of each is a warm-up
        started = time.perf_counter()
        with torch.no_grad():
            hf(ids)
        forward.append(time.perf_counter() - started)
        started = time.perf_counter()
        logits = hf(ids).logits
        torch.log_softmax(logits.float(), dim=-1).mean().backward()
        hf.zero_grad(set_to_none=True)
        backward.append(time.perf_counter() - started)
    return statistics.median(forward[1:]), statistics.median(backward[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--heldout", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from relayrl_testkit.helpers.real_model import smollm2_dir

    model = smollm2_dir("fp32")
    with tempfile.TemporaryDirectory(prefix="real-model-bench-") as tmp:
        run_dir = run_up(model, args, Path(tmp))
        steps = read_jsonl(run_dir / "trainer" / "steps.jsonl")
        timing = {r["step"]: r for r in read_jsonl(run_dir / "reward_timing.jsonl")}
        evals = read_jsonl(run_dir / "eval.jsonl")
        prompt_len = mean_prompt_tokens(run_dir, model)

    rows = args.batch_groups * args.samples
    response_len = statistics.fmean(r["trained_response_len_mean"] for r in steps)
    names = ("generation", "reward", "old_logprobs", "update", "sync")
    phases: dict[str, list[float]] = {name: [] for name in names}
    generated = 0.0
    for record in steps[1:]:  # the first step also pays the engine's and trainer's warm-up
        p = record["phases_s"]
        reward = timing.get(record["step"], {}).get("t_collect_s", 0.0)
        phases["reward"].append(reward)
        phases["generation"].append(max(p["wait"] - reward, 1e-9))
        phases["old_logprobs"].append(p["old_logprobs"])
        phases["update"].append(p["update"])
        phases["sync"].append(p["publish"])
        generated += record["trained_tokens"]
    trainer_tokens = rows * (prompt_len + response_len)
    trainer_s = statistics.fmean(phases["old_logprobs"]) + statistics.fmean(phases["update"])
    trainer_tok_s = trainer_tokens / trainer_s
    engine_tok_s = generated / sum(phases["generation"])
    sync_s = statistics.median(phases["sync"])

    hf_forward, hf_backward = transformers_reference(
        model, rows, round(prompt_len + response_len), args.repeats
    )
    ratio = trainer_s / (hf_forward + hf_backward)

    print()
    print(f"SmolLM2-135M-Instruct on reasoning_gym:{args.dataset}, sync, {rows} rows per step "
          f"(prompt {prompt_len:.0f} + response {response_len:.0f} tokens on average), "
          f"steps 2..{len(steps)}")  # fmt: skip
    print(f"{'phase':<14}{'mean s':>9}{'max s':>9}")
    for name, values in phases.items():
        print(f"{name:<14}{statistics.fmean(values):>9.2f}{max(values):>9.2f}")
    print(f"{'hf forward':<14}{hf_forward:>9.2f}")
    print(f"{'hf fwd+bwd':<14}{hf_backward:>9.2f}")
    start = next(e for e in evals if e["kind"] == "warm_start")
    final = next(e for e in reversed(evals) if e["kind"] == "final")
    rewards = f"{steps[0]['reward_mean']:.2f} -> {steps[-1]['reward_mean']:.2f}"
    print(
        f"held-out accuracy (greedy, n={final['n']}): {start['accuracy']:.1%} at version 0 -> "
        f"{final['accuracy']:.1%} at version {final['version']}; train reward {rewards}"
    )
    print(
        f"real-model-bench: trainer_tok_s={trainer_tok_s:.1f} engine_tok_s={engine_tok_s:.1f} "
        f"sync_s={sync_s:.2f} trainer_vs_hf={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
