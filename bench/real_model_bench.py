"""SmolLM2-135M-Instruct through `relayrl up` on the user's path, each part measured inside the
run against the best the same cores do without relayrl.

The run is the user's: `relayrl up --model ... --data train.jsonl --heldout test.jsonl` on
the GSM8K-style word problems of make bench-learn-real (relayrl_testkit.word_problems), with
every training default (mode, learning rate, filter, temperature, budget, micro-batches);
only the sizes and the steps are small. It runs with `placement:` (the engine on one core,
the trainer and the services on the other), as on a cluster the engine and the trainer have
their own accelerators.

Measured inside the run:
    old logprobs, update, sync   the trainer's own phases per step (steps.jsonl), steps 2..n
    trainer tokens/s             trained tokens (prompt + response of every row) over old
                                 logprobs + update
    engine tokens/s              vLLM's own generation throughput, logged every 10 s by the
                                 engine, over the intervals it was decoding (the median)
    peak RSS                     the trainer process's VmHWM, read from /proc during the run

The references, side by side after the run, on the same cores at once:
    bare PyTorch   transformers' model for the same checkpoint in the trainer's dtype, on the
                   trainer's core, over the very rows of the run's steps (lengths and
                   micro-batches as the trainer padded them): a no-grad forward for old
                   log-probs, a forward and backward pass, one AdamW step
    vLLM           `LLM.generate` on the engine's core with the engine's settings, over the
                   run's prompts, as many sequences at once as the engine decoded in the run
                   (the median of its logged intervals), at the run's temperature and budget,
                   while the PyTorch reference runs on the other core

The last line is exactly:
    real-model-bench: trainer_vs_torch=<r> engine_vs_vllm=<r> sync_s=<s> peak_rss_gb=<g> \
trainer_tok_s=<x> engine_tok_s=<y>
(one line) where trainer_vs_torch = reference seconds / trainer seconds over the same steps and
engine_vs_vllm = engine tokens/s / vLLM tokens/s. Targets (issue 34): both >= 0.9,
peak_rss_gb < 4, sync_s <= 0.5.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from up_runs import UpRun, default_placement, run_up

from relayrl.core.records import StepRecord
from relayrl.up.defaults import Training

THROUGHPUT = re.compile(r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs")
VM_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


def up_config(args: argparse.Namespace, placement: dict[str, str]) -> dict:
    return {
        "train": {
            "steps": args.steps, "batch_groups": args.batch_groups,
            "samples_per_prompt": args.samples, "checkpoint_interval_steps": args.steps,
        },
        "eval": {"interval_steps": 0},
        "placement": placement,
    }  # fmt: skip


# -- the run ---------------------------------------------------------------------------------


class TrainerPeakRss:
    """The largest VmHWM of the run's trainer process (each one, if it restarted), read from
    /proc each time `relayrl up`'s watcher calls it; VmHWM is the kernel's own high-water mark,
    so the polling interval loses nothing."""

    def __init__(self) -> None:
        self.peak_kb = 0

    def __call__(self, run_dir: Path) -> bool:
        from relayrl_testkit.helpers.up import stack_pid

        pid = stack_pid(run_dir, "trainer")
        try:
            status = Path(f"/proc/{pid}/status").read_text() if pid else ""
        except OSError:
            status = ""
        if match := VM_HWM.search(status):
            self.peak_kb = max(self.peak_kb, int(match.group(1)))
        return False  # keep watching until the run ends

    @property
    def gb(self) -> float:
        return self.peak_kb / 1024**2


def run_bench(model: Path, args: argparse.Namespace, workdir: Path,
              placement: dict[str, str]) -> tuple[UpRun, float]:  # fmt: skip
    from relayrl_testkit.word_problems import write_dataset

    train, heldout = write_dataset(workdir / "data", 400, args.heldout)
    print(f"relayrl up on SmolLM2, {args.steps} steps, user defaults, engine on CPU "
          f"{placement['engine']}, trainer and services on CPU {placement['trainer']} "
          f"(log: {workdir / 'real-model.log'})", flush=True)  # fmt: skip
    peak = TrainerPeakRss()
    run = run_up(
        "real-model", up_config(args, placement), workdir, bench="real-model-bench",
        extra_args=["--model", str(model), "--data", str(train), "--heldout", str(heldout)],
        watch=peak,
    )  # fmt: skip
    print(f"  done in {run.wall_s:.0f} s", flush=True)
    output = (workdir / "real-model.log").read_text(errors="replace")
    for line in output.splitlines():
        if line.startswith("training settings for"):
            print("  " + line, flush=True)
    print("  " + output.strip().splitlines()[-1], flush=True)  # relayrl up's own summary
    return run, peak.gb


def engine_tok_s(run_dir: Path) -> tuple[float, int, int]:
    """The median of vLLM's logged generation throughput over the intervals it was decoding
    (the engine logs it every 10 s), how many intervals that is, and the median number of
    sequences it was decoding at once."""
    rates, running_counts = [], []
    for log in sorted((run_dir / "logs").glob("engine-*.log")):
        for match in THROUGHPUT.finditer(log.read_text(errors="replace")):
            rate, running = float(match.group(1)), int(match.group(2))
            if running > 0 and rate > 0:
                rates.append(rate)
                running_counts.append(running)
    if not rates:
        sys.exit(f"real-model-bench: no engine throughput lines in {run_dir}")
    return statistics.median(rates), len(rates), round(statistics.median(running_counts))


# -- the references --------------------------------------------------------------------------


def vllm_reference(model: Path, prompts: list[str], rows: int, settings: dict, out: Path,
                   stop: Path) -> subprocess.Popen:  # fmt: skip
    """Starts `LLM.generate` rounds on the engine's core until `stop` exists: `rows` sequences
    decoded at once (max_num_seqs), four times as many prompts queued per round so that the
    batch stays full as sequences finish, as the run's queue keeps it; each round's tokens and
    seconds are appended to `out`."""
    script = f"""
import json, time, os
from pathlib import Path
from vllm import LLM, SamplingParams
llm = LLM(model={str(model)!r}, dtype="float32", enforce_eager=True,
          distributed_executor_backend="uni", max_model_len={settings["max_model_len"]},
          max_num_seqs={rows}, seed=0, enable_prefix_caching=False,
          logprobs_mode="processed_logprobs")
prompts = {prompts!r}
params = SamplingParams(temperature={settings["temperature"]}, max_tokens={settings["max_tokens"]},
                        logprobs=0)
Path({str(out)!r}).write_text("")
n = 0
while not Path({str(stop)!r}).exists():
    batch = [prompts[(n * {4 * rows} + i) % len(prompts)] for i in range({4 * rows})]
    n += 1
    started = time.perf_counter()
    results = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    with open({str(out)!r}, "a") as f:
        f.write(json.dumps({{"tokens": tokens, "seconds": seconds}}) + "\\n")
"""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(settings["kv_cache_gib"]))
    return subprocess.Popen(
        ["taskset", "-c", settings["cpus"], sys.executable, "-c", script],
        env=env, stdout=subprocess.DEVNULL, stderr=(out.parent / "vllm-reference.log").open("w"),
    )  # fmt: skip


def micro_batches(lengths: list[int], rows: int, tokens: int | None) -> list[list[int]]:
    import torch

    from relayrl.trainer.forward import TokenBatch
    from relayrl.trainer.forward import micro_batches as split

    width = max(lengths)
    batch = TokenBatch(torch.zeros(len(lengths), width, dtype=torch.long), torch.tensor(lengths))
    return [[lengths[i] for i in range(m.rows.start, m.rows.stop)]
            for m in split(batch, rows, tokens)]  # fmt: skip


def torch_reference(
    model: Path, steps: list[StepRecord], training: Training, repeats: int
) -> list[dict]:
    """Seconds of the three phases of each step over its own rows, bare PyTorch, fp32, on this
    process's CPUs (the trainer's)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=training.lr)
    gen = torch.Generator().manual_seed(0)
    temperature = training.temperature

    def logp(ids: torch.Tensor) -> torch.Tensor:
        logits = hf(ids).logits[:, :-1].float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def one(step: StepRecord) -> dict:
        parts = [
            torch.randint(3, hf.config.vocab_size, (len(mb), max(mb)), generator=gen)
            for mb in micro_batches(
                step.row_tokens, training.micro_batch_size, training.micro_batch_tokens
            )
        ]
        clock = time.perf_counter()
        with torch.no_grad():
            for ids in parts:
                logp(ids)
        old = time.perf_counter() - clock
        clock = time.perf_counter()
        for ids in parts:
            (logp(ids).sum() * 1e-3).backward()
        forward_backward = time.perf_counter() - clock
        clock = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return {"old_logprobs": old, "fwd_bwd": forward_backward,
                "optimizer": time.perf_counter() - clock}  # fmt: skip

    one(steps[0])  # warm-up: allocator, Adam's state
    out = []
    for step in steps:
        runs = [one(step) for _ in range(repeats)]
        out.append({k: statistics.median(r[k] for r in runs) for k in runs[0]})
    return out


def rendered_prompts(run_dir: Path, model: Path) -> list[str]:
    from transformers import AutoTokenizer

    from relayrl.conversation.rendering import render

    tokenizer = AutoTokenizer.from_pretrained(model)
    lines = (run_dir / "data" / "prompts.jsonl").read_text().splitlines()[:64]
    records = [json.loads(line) for line in lines]  # task data: not a run record
    return [render(tokenizer, r["messages"], None, True) for r in records]


# -- the report ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--heldout", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    placement = default_placement()
    if placement is None:
        sys.exit("real-model-bench: needs 2 CPUs or more (the engine on its own)")

    from relayrl.up.config import parse_cpu_list
    from relayrl_testkit.helpers.real_model import smollm2_dir

    model = smollm2_dir("fp32")
    with tempfile.TemporaryDirectory(prefix="real-model-bench-") as tmp:
        workdir = Path(tmp)
        run, peak_gb = run_bench(model, args, workdir, placement)
        steps = run.steps[1:]  # step 1 pays the warm-ups
        state, engine = run.state, run.config["engine"]
        training = state.training
        engine_rate, intervals, running = engine_tok_s(run.run_dir)
        prompts = rendered_prompts(run.run_dir, model)
        settings = {
            "cpus": placement["engine"], "max_model_len": engine["max_model_len"],
            "kv_cache_gib": engine["kv_cache_gib"], "temperature": training.temperature,
            "max_tokens": training.max_tokens,
        }  # fmt: skip
        out, stop = workdir / "vllm-reference.jsonl", workdir / "stop"
        print(f"references: vLLM on CPU {placement['engine']} beside bare PyTorch on CPU "
              f"{placement['trainer']}", flush=True)  # fmt: skip
        vllm = vllm_reference(model, prompts, running, settings, out, stop)
        os.sched_setaffinity(0, parse_cpu_list(placement["trainer"]))
        try:
            while not out.exists() and vllm.poll() is None:  # the engine is generating first
                time.sleep(1)
            reference = torch_reference(model, steps, training, args.repeats)
        finally:
            stop.touch()
            vllm.wait(timeout=600)
        # the reference's own output, one round a line; the first round warms up
        rounds = [json.loads(x) for x in out.read_text().splitlines()[1:]] if out.exists() else []
        if not rounds:
            log = (workdir / "vllm-reference.log").read_text()[-2000:]
            sys.exit(f"real-model-bench: the vLLM reference generated nothing:\n{log}")
        vllm_rate = sum(r["tokens"] for r in rounds) / sum(r["seconds"] for r in rounds)

    phases = {
        name: [s.phases_s.get(key, 0.0) for s in steps]
        for name, key in (("old_logprobs", "old_logprobs"), ("update", "update"),
                          ("sync", "publish"), ("wait", "wait"))
    }  # fmt: skip
    trainer_s = sum(phases["old_logprobs"]) + sum(phases["update"])
    reference_s = sum(sum(r.values()) for r in reference)
    trained_tokens = sum(s.trained_tokens or 0.0 for s in steps)
    trainer_rate = trained_tokens / trainer_s
    sync_s = statistics.median(phases["sync"])
    mean_len = statistics.fmean(n for s in steps for n in s.row_tokens)

    print()
    print(f"SmolLM2-135M-Instruct on word problems, {state.mode}, steps "
          f"2..{len(steps) + 1}: {statistics.fmean(len(s.row_tokens) for s in steps):.1f} "
          f"rows of {mean_len:.0f} tokens (prompt + response) per step")  # fmt: skip
    print(f"{'phase':<28}{'relayrl s':>10}{'torch s':>10}{'ratio':>8}")
    ref = {k: sum(r[k] for r in reference) for k in reference[0]}
    old_ratio = ref["old_logprobs"] / sum(phases["old_logprobs"])
    update_ref = ref["fwd_bwd"] + ref["optimizer"]
    print(f"{'old logprobs':<28}{sum(phases['old_logprobs']):>10.2f}"
          f"{ref['old_logprobs']:>10.2f}{old_ratio:>8.2f}")  # fmt: skip
    print(f"{'update (fwd+bwd+optimizer)':<28}{sum(phases['update']):>10.2f}"
          f"{update_ref:>10.2f}{update_ref / sum(phases['update']):>8.2f}")  # fmt: skip
    print(f"{'  torch fwd+bwd':<28}{'':>10}{ref['fwd_bwd']:>10.2f}")
    print(f"{'  torch AdamW':<28}{'':>10}{ref['optimizer']:>10.2f}")
    print(f"{'weight sync per version':<28}{sync_s:>10.2f}")
    print(f"{'trainer wait for groups':<28}{sum(phases['wait']):>10.2f}")
    print(f"engine: {engine_rate:.1f} tokens/s inside the run (median of {intervals} intervals); "
          f"vLLM LLM.generate, {running} sequences at once (the run's median): "
          f"{vllm_rate:.1f} tokens/s over "
          f"{len(rounds)} rounds")  # fmt: skip
    print(f"trainer peak RSS {peak_gb:.2f} GB; {trained_tokens:.0f} trained tokens")
    print(
        f"real-model-bench: trainer_vs_torch={reference_s / trainer_s:.2f} "
        f"engine_vs_vllm={engine_rate / vllm_rate:.2f} sync_s={sync_s:.2f} "
        f"peak_rss_gb={peak_gb:.2f} trainer_tok_s={trainer_rate:.1f} "
        f"engine_tok_s={engine_rate:.1f}"
    )


if __name__ == "__main__":
    main()
