"""The GPU path of "train your own model", as one prepared check: SmolLM2-135M-Instruct (bf16)
through megatron-core on CUDA, then a short `relayrl up` with the engine on CUDA (vLLM), the
trainer in bf16 and weight-sync over NCCL (torch_distributed). A few minutes on one GPU.

    python bench/gpu_real_model_check.py [--steps 3]

It prints one line per check and ends with
    gpu-real-model-check: logits_max_abs=<x> steps=<n> committed=<n> sync_s=<median s> ok=<bool>
and exits 1 when a check fails. tests/gpu/test_gpu_real_model.py runs it (marked `gpu`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from relayrl.core.records import StepRecord, TransferRecord, read_records

# bf16 on both sides, 30 layers: logits of size ~20 agree to a few tenths at worst.
LOGITS_TOL = 1.0


def megatron_logits(rank: int, world_size: int, hf_dir: Path, ids):  # type: ignore[no-untyped-def]
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir

    init_parallel(tensor_model_parallel_size=world_size, seed=0)
    model = build_model(ModelSpec.from_hf_dir(hf_dir), params_dtype=torch.bfloat16)
    load_hf_dir(model, hf_dir)
    ids = ids.cuda()
    seq_len = ids.shape[1]
    position_ids = torch.arange(seq_len, device="cuda").unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device="cuda"), 1)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(ids, position_ids, mask))
    return logits.float().cpu()


def check_megatron(model: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from relayrl.trainer.model import spawn_ranks

    ids = torch.randint(3, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    (logits,) = spawn_ranks(megatron_logits, 1, model, ids, timeout_s=600)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        expected = hf(ids.cuda()).logits.float().cpu()
    return float((logits - expected).abs().max())


def check_up(model: Path, steps: int, workdir: Path) -> tuple[int, int, float]:
    config = {
        "task": {"options": {"max_terms": 2, "max_digits": 2}, "heldout_prompts": 20},
        "train": {
            "steps": steps, "batch_groups": 4, "samples_per_prompt": 4, "max_tokens": 128,
            "lr": 1e-6, "checkpoint_interval_steps": steps,
        },
        "eval": {"interval_steps": 0, "sampled": False},
        "weightsync": {"transport": "torch_distributed"},
        "services": {"trainer": {"model": {"params_dtype": "bfloat16"}}},
    }  # fmt: skip
    (workdir / "up.yaml").write_text(yaml.safe_dump(config))
    argv = [
        str(Path(sys.executable).parent / "relayrl"), "up", "--model", str(model),
        "--task", "reasoning_gym:basic_arithmetic", "--config", str(workdir / "up.yaml"),
        "--runs-dir", str(workdir / "runs"),
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    print(result.stdout[-2000:])
    if result.returncode != 0:
        print(result.stderr[-2000:])
        return 0, 0, float("nan")
    run_dir = Path(next(x for x in result.stdout.splitlines() if x.startswith("relayrl up: run "))
                   .rsplit(" ", 1)[-1])  # fmt: skip
    steps_done = len(read_records(run_dir / "trainer" / "steps.jsonl", StepRecord))
    transfers = read_records(run_dir / "weightsync" / "transfers.jsonl", TransferRecord)
    committed = [t for t in transfers if t.state == "committed"]
    sync = [sum(t.durations_s.values()) for t in committed] or [float("nan")]
    return steps_done, len(committed), statistics.median(sync)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu-real-model-check: no CUDA device here")
        return 2
    from relayrl_testkit.helpers.real_model import smollm2_dir

    model = smollm2_dir("bf16")
    logits = check_megatron(model)
    print(f"megatron bf16 on CUDA vs transformers: largest |logit difference| {logits:.3f}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        steps, committed, sync_s = check_up(model, args.steps, Path(tmp))
    ok = logits < LOGITS_TOL and steps == args.steps and committed == args.steps
    print(
        f"gpu-real-model-check: logits_max_abs={logits:.3f} steps={steps} "
        f"committed={committed} sync_s={sync_s:.2f} ok={str(ok).lower()}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
