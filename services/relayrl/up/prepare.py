"""Everything a run needs before any service starts: the workload's data files, the model
(the user's folder, or the tiny model built from its seed) and the tiny model's supervised warm
start.

The model and the warm start are cached under `<runs>/cache/` by a digest of everything that
decides them (sizes and seeds; task, knobs and SFT settings), so a second run, or a test,
starts from the same weights in seconds. A cache entry is written to a temporary folder and
renamed into place, so an interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relayrl.tasks import Task, write_jsonl
from relayrl.up.config import UpConfig

if TYPE_CHECKING:
    from relayrl.up.workload import Workload

logger = logging.getLogger(__name__)

# Per built-in task: the longest SFT example in tokens (lookup carries ~570 tokens of tool
# schemas and two tool turns).
SFT_MAX_SEQ_LEN: dict[str, int] = {"arith": 128, "lookup": 1024}


class PrepareError(RuntimeError):
    """A step before training failed; the message says which and where its log is."""


def max_tokens(config: UpConfig) -> int:
    """The response token budget: train.max_tokens, else the task's or the model's default."""
    return config.training.max_tokens


def sft_micro_batch_size(config: UpConfig) -> int:
    """Rows per forward pass of the warm start. Part of its cache key: the loss is the same
    for any size, but float sums in another order send a tiny model's training elsewhere."""
    return min(config.warm_start.batch_size, 64)


def sft_max_seq_len(config: UpConfig) -> int:
    return config.warm_start.max_seq_len or SFT_MAX_SEQ_LEN[config.task.name]


@dataclass(frozen=True)
class RunFiles:
    prompts: Path
    heldout: Path
    sft: Path
    sft_eval: Path

    @classmethod
    def in_dir(cls, data_dir: Path) -> RunFiles:
        names = ("prompts", "heldout", "sft", "sft_eval")
        return cls(*(data_dir / f"{name}.jsonl" for name in names))


def write_task_files(workload: Workload, config: UpConfig, data_dir: Path) -> RunFiles:
    """prompts.jsonl (training), heldout.jsonl (evaluation), and for a built-in task sft.jsonl
    (warm start) and sft_eval.jsonl (training questions held aside from the warm start, for its
    target; both empty otherwise). Every split is by question or prompt, so no held-out
    question is ever a prompt or an SFT example."""
    files = RunFiles.in_dir(data_dir)
    write_jsonl(workload.train, files.prompts)
    write_jsonl(workload.heldout, files.heldout)
    task, ws = workload.task, config.warm_start
    sft = task.sft_examples(ws.examples, ws.seed) if task and config.warm_start_enabled else []
    write_jsonl(sft, files.sft)
    write_jsonl(_held_aside(task, sft, ws.eval_examples, ws.seed) if sft else [], files.sft_eval)
    return files


def _held_aside(task: Task, sft: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """Up to `n` SFT-style examples of training questions that are not SFT examples."""
    taken = {json.dumps(r, sort_keys=True) for r in sft}
    for draw in (3 * n, 2 * n, n):
        try:
            questions = task.questions("train", draw, seed, stream="sft-eval")
            break
        except ValueError:  # the split holds fewer distinct questions
            continue
    else:
        return []
    aside = [
        record
        for question in questions
        for record in task.sft_turns(question)
        if json.dumps(record, sort_keys=True) not in taken
    ]
    return aside[:n]


_PROGRESS_LINE = re.compile(
    r"sft epoch (?P<epoch>\d+): loss (?P<loss>[0-9.]+)(?:, eval accuracy (?P<accuracy>[0-9.]+))?"
    r"|sft: eval accuracy (?P<reached>[0-9.]+) reached the target [0-9.]+ at update (?P<update>\d+)"
)


def _wait_reporting_epochs(
    process: subprocess.Popen[bytes],
    log_path: Path,
    epochs: int,
    started: float,
    say: Callable[[str], None],
) -> int:
    """Waits for the SFT process, saying each epoch's loss as its log reports it, and where it
    reached its target."""
    reported = 0
    while True:
        try:
            code = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        for match in list(_PROGRESS_LINE.finditer(text))[reported:]:
            reported += 1
            elapsed = f"({time.monotonic() - started:.0f} s)"
            if match["reached"]:
                say(
                    f"warm start: a sample answers {float(match['reached']):.1%} after update "
                    f"{match['update']}: target reached {elapsed}"
                )
                continue
            accuracy = match["accuracy"]
            accuracy = f", sampled accuracy {float(accuracy):.1%}" if accuracy else ""
            say(
                f"warm start: epoch {match['epoch']}/{epochs}, loss {float(match['loss']):.3f}"
                f"{accuracy} {elapsed}"
            )
        if code is not None:
            return code


def digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cached(path: Path, build: Callable[[Path], None]) -> Path:
    """`path` if it exists, else built into a sibling temporary folder and renamed. Two runs
    that build the same entry at once both succeed: the second rename finds the first's entry
    (the same inputs, so the same content) and keeps it."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        build(scratch)
        try:
            scratch.rename(path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def base_model(config: UpConfig, say: Callable[[str], None]) -> Path:
    """The user's model folder, or the tiny model (random weights from its seed) and its
    tokenizer, built once per config."""
    from relayrl.models.tiny import init_model

    model = config.model
    if model.path is not None:
        say(f"model: {model.path}")
        return model.path
    sizes = model.model_dump(mode="json", exclude={"path"})
    path = config.runs_dir / "cache" / f"model-{digest(sizes)}"
    if path.exists():
        say(f"model: {path} (cached)")
        return path

    built = []
    _cached(path, lambda out: built.append(init_model(out, model)))
    info = built[0]
    say(f"model: built a tiny Qwen2 in {path} ({info.num_params} parameters)")
    return path


def warm_start(
    config: UpConfig, model_dir: Path, files: RunFiles, log_path: Path, say: Callable[[str], None]
) -> Path:
    """`relayrl-trainer sft` on the task's examples, once per (model, task, settings)."""
    if not config.warm_start_enabled:
        return model_dir
    ws = config.warm_start
    key = digest(
        {
            "model": model_dir.name,
            "task": config.task.name,
            "options": config.task.options,
            "warm_start": ws.model_dump(mode="json"),
            "max_seq_len": sft_max_seq_len(config),
            "micro_batch_size": sft_micro_batch_size(config),
        }
    )
    path = config.runs_dir / "cache" / f"warm-{config.task.name}-{key}"
    if path.exists():
        say(f"warm start: {path} (cached)")
        return path

    def build(out: Path) -> None:
        from relayrl.core.service_process import console_script

        target = (
            f"until a sample answers {ws.target_accuracy:.0%} of held-aside questions, at most "
            if ws.target_accuracy is not None
            else ""
        )
        say(
            f"warm start: SFT on {ws.examples} {config.task.name} examples, {target}"
            f"{ws.epochs} epochs (log: {log_path})"
        )
        argv = [
            console_script("relayrl-trainer"),
            "sft",
            "--model", str(model_dir),
            "--data", str(files.sft),
            "--out", str(out),
            "--epochs", str(ws.epochs),
            "--lr", str(ws.lr),
            "--warmup-updates", str(ws.warmup_updates),
            "--schedule", ws.schedule,
            "--min-lr", str(ws.lr / 10),  # the cosine's floor; constant ignores it
            "--batch-size", str(ws.batch_size),
            "--micro-batch-size", str(sft_micro_batch_size(config)),
            "--max-seq-len", str(sft_max_seq_len(config)),
            "--seed", str(ws.seed),
        ]  # fmt: skip
        if ws.target_accuracy is not None and files.sft_eval.stat().st_size:
            argv += [
                "--eval-data", str(files.sft_eval),
                "--target-accuracy", str(ws.target_accuracy),
                "--eval-every", str(ws.eval_every),
            ]  # fmt: skip
        started = time.monotonic()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                code = _wait_reporting_epochs(process, log_path, ws.epochs, started, say)
            except BaseException:  # Ctrl-C: the SFT child goes with us
                process.kill()
                process.wait()
                raise
        if code != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise PrepareError(
                f"warm start failed (exit {code}): {tail[0] if tail else ''} (see {log_path})"
            )
        say(f"warm start: done in {time.monotonic() - started:.0f} s")

    return _cached(path, build)
