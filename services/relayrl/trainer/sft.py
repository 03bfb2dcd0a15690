"""`relayrl-trainer sft`: supervised warm start on prompt/answer pairs, writing an HF folder.

RL from a random policy never sees a reward; the warm start teaches the answer format so that
GRPO has groups with signal from the first step. Prompts are rendered exactly as the gateway
renders them for rollout (the tokenizer's chat template with the generation prompt), and the
loss covers only the answer tokens plus the closing `<|im_end|>`.

Data: JSONL, one `{"prompt": str | "messages": [...], "answer": str}` per line.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


class SftDataError(ValueError):
    """A dataset line that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class SftConfig:
    model: Path
    data: Path
    out: Path
    epochs: int = 1
    lr: float = 1e-3
    warmup_updates: int = 0
    """Linear warm-up of the learning rate from 0, in updates; then `schedule`."""
    schedule: str = "constant"
    """constant, or cosine from lr down to `min_lr` over every update of `epochs`."""
    min_lr: float = 0.0
    batch_size: int = 16
    micro_batch_size: int = 8
    max_seq_len: int = 512
    seed: int = 0
    tensor_parallel: int = 1
    eval_data: Path | None = None
    """Held-aside examples (same format): at each check (each epoch's end, and every
    `eval_every` updates), the expected exact-match accuracy of a sample at temperature 1 on
    them (the mean of exp(sum of the answer's log-probs))."""
    target_accuracy: float | None = None
    """Stop at the first check whose eval accuracy reaches this (needs eval_data)."""
    eval_every: int = 0
    """Also check the eval accuracy every this many updates, counted over the whole run (0: at
    the end of each epoch only). A tiny model's accuracy can jump from well under the target
    to well over it within one epoch; checks inside the epoch stop it near the target."""


@dataclass
class SftExample:
    input_ids: np.ndarray
    mask: np.ndarray  # 1 on answer tokens (the positions whose log-prob is trained)


def load_examples(settings: SftConfig, tokenizer, path: Path | None = None) -> list[SftExample]:
    """The examples of `path` (default: `settings.data`), tokenized as rollout renders them."""
    from relayrl.conversation.rendering import prompt_token_ids, turn_end_token_ids
    from relayrl.proto.common.v1 import common_pb2

    path = path or settings.data
    end = list(turn_end_token_ids(tokenizer))
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SftDataError(f"{path}: cannot read ({exc.strerror})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SftDataError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("answer"), str):
            raise SftDataError(f"{where}: needs a string `answer` and a `prompt` or `messages`")
        if isinstance(raw.get("prompt"), str):
            messages = [common_pb2.ChatMessage(role="user", content=raw["prompt"])]
        elif isinstance(raw.get("messages"), list):
            messages = [
                common_pb2.ChatMessage(role=str(m.get("role")), content=str(m.get("content")))
                for m in raw["messages"]
            ]
        else:
            raise SftDataError(f"{where}: needs a `prompt` string or a `messages` list")
        group = common_pb2.PromptGroup(uid="sft", messages=messages)
        prompt = prompt_token_ids(group, tokenizer, tools=None)
        answer = list(tokenizer.encode(raw["answer"], add_special_tokens=False)) + end
        ids = np.asarray(prompt + answer, dtype=np.int64)[: settings.max_seq_len]
        mask = np.zeros(len(ids), dtype=np.float32)
        mask[len(prompt) :] = 1.0
        if not mask.any():
            raise SftDataError(
                f"{where}: the prompt alone fills max_seq_len {settings.max_seq_len}"
            )
        examples.append(SftExample(ids, mask))
    if not examples:
        raise SftDataError(f"{path}: no examples")
    return examples


def sampled_accuracy(model, examples: list[SftExample], micro_batch_size: int) -> float:
    """Expected exact-match accuracy of one sample at temperature 1: the mean over examples of
    the probability of the whole answer, exp(sum of its tokens' log-probs). Forward only."""
    from relayrl.trainer.forward import TokenBatch, forward_logprobs

    total = 0.0
    for first in range(0, len(examples), 256):
        chunk = examples[first : first + 256]
        ids, lengths, mask = _collate(chunk)
        batch = TokenBatch.scoring(ids, lengths, mask)
        logp = forward_logprobs(model, batch, micro_batch_size=micro_batch_size)
        total += float(torch.exp((logp * mask).sum(dim=1)).sum())
    return total / len(examples)


def _collate(examples: list[SftExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), T, dtype=torch.int64)
    lengths = torch.zeros(len(examples), dtype=torch.int64)
    mask = torch.zeros(len(examples), T)
    for b, e in enumerate(examples):
        ids[b, : len(e.input_ids)] = torch.from_numpy(e.input_ids)
        lengths[b] = len(e.input_ids)
        mask[b, : len(e.mask)] = torch.from_numpy(e.mask)
    return ids, lengths, mask


def _nll_loss(mask_BT: torch.Tensor, num_tokens: float, sums: list[float]):
    """Mean negative log-likelihood of the answer tokens, over the whole batch."""

    def loss_fn(logp_bT: torch.Tensor, rows: slice) -> tuple[torch.Tensor, dict[str, float]]:
        nll = -(logp_bT * mask_BT[rows]).sum()
        sums.append(float(nll.detach()))
        return nll / num_tokens, {}

    return loss_fn


def run_sft(settings: SftConfig) -> dict[str, float]:
    """Trains and writes `settings.out`; returns the first and last epoch's mean loss."""
    from transformers import AutoTokenizer

    from relayrl.trainer.config import OptimizerConfig
    from relayrl.trainer.forward import TokenBatch, forward_backward, optimizer_step
    from relayrl.trainer.hf_mapping import ModelSpec
    from relayrl.trainer.model import build_model, init_parallel, load_hf_dir, save_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    examples = load_examples(settings, tokenizer)
    held_aside = (
        load_examples(settings, tokenizer, settings.eval_data) if settings.eval_data else []
    )
    init_parallel(settings.tensor_parallel, settings.seed)
    spec = ModelSpec.from_hf_dir(settings.model)
    model = build_model(spec)
    load_hf_dir(model, settings.model)
    optim = OptimizerConfig(
        lr=settings.lr,
        min_lr=settings.min_lr,
        schedule=settings.schedule,
        warmup_updates=settings.warmup_updates,
        clip_grad=1.0,
    )
    optimizer = optim.build(model)
    updates_per_epoch = math.ceil(len(examples) / settings.batch_size)
    scheduler = optim.build_scheduler(optimizer, settings.epochs * updates_per_epoch)
    rng = random.Random(settings.seed)
    epoch_losses = []
    eval_accuracy = 0.0
    updates = 0
    stop = False
    start = time.perf_counter()

    def check(where: str) -> bool:
        """Measures the eval accuracy; True when it reaches the target."""
        nonlocal eval_accuracy
        eval_accuracy = sampled_accuracy(model, held_aside, settings.micro_batch_size)
        lr = optimizer.param_groups[0]["lr"]
        logger.info("sft %s: eval accuracy %.4f, lr %.3g", where, eval_accuracy, lr)
        return settings.target_accuracy is not None and eval_accuracy >= settings.target_accuracy

    for epoch in range(settings.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        losses = []
        for first in range(0, len(order), settings.batch_size):
            batch = [examples[i] for i in order[first : first + settings.batch_size]]
            ids, lengths, mask = _collate(batch)
            nll_sums: list[float] = []
            forward_backward(
                model,
                TokenBatch.scoring(ids, lengths, mask),
                micro_batch_size=settings.micro_batch_size,
                temperature=1.0,
                loss_fn=_nll_loss(mask, float(mask.sum()), nll_sums),
            )
            optimizer_step(optimizer)
            scheduler.step(increment=1)
            updates += 1
            losses.append(sum(nll_sums) / float(mask.sum()))
            inside_epoch = first + settings.batch_size < len(order)  # its end checks below
            due = bool(held_aside) and settings.eval_every and updates % settings.eval_every == 0
            if due and inside_epoch and check(f"update {updates} (epoch {epoch + 1})"):
                stop = True
                break
        epoch_losses.append(float(np.mean(losses)))
        accuracy = ""
        if held_aside:
            stop = stop or check(f"update {updates} (end of epoch {epoch + 1})")
            accuracy = f", eval accuracy {eval_accuracy:.4f}"
        lr = optimizer.param_groups[0]["lr"]
        logger.info("sft epoch %d: loss %.4f%s, lr %.3g", epoch + 1, epoch_losses[-1], accuracy, lr)
        if stop:
            logger.info(
                "sft: eval accuracy %.4f reached the target %.4f at update %d: stopping",
                eval_accuracy,
                settings.target_accuracy,
                updates,
            )
            break
    save_hf_dir(model, spec, settings.out, tokenizer_from=settings.model)
    result = {
        "first_epoch_loss": epoch_losses[0],
        "last_epoch_loss": epoch_losses[-1],
        "epochs": float(len(epoch_losses)),
        "updates": float(updates),
        "examples": float(len(examples)),
        "duration_s": time.perf_counter() - start,
        "perplexity": math.exp(min(epoch_losses[-1], 50.0)),
    }
    if held_aside:
        result["eval_accuracy"] = eval_accuracy
    return result
