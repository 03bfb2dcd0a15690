"""`relayrl-trainer sft`: the warm start, as a real process on the tiny model. The written
folder is checked with `transformers` (independent of megatron): the answers' likelihood under
the chat template the gateway renders went up."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch

from relayrl.core.service_process import console_script

pytestmark = pytest.mark.slow


def pairs(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"prompt": f"{a}+{b}=", "answer": f"The answer is {a + b}."})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("relayrl-trainer"), "sft", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def answer_token_logprobs(model_dir: Path, rows: list[dict[str, str]]) -> list[torch.Tensor]:
    """Per row, the log-probs of the answer's tokens and its <|im_end|>, with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    out = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        p = tokenizer.encode(prompt, add_special_tokens=False)
        a = [
            *tokenizer.encode(row["answer"], add_special_tokens=False),
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
        ]
        ids = torch.tensor([p + a])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
        targets = ids[0, 1:]
        out.append(logp[torch.arange(len(targets)), targets][len(p) - 1 :])
    return out


def answer_nll(model_dir: Path, rows: list[dict[str, str]]) -> float:
    """Mean negative log-likelihood per answer token."""
    token_logps = answer_token_logprobs(model_dir, rows)
    return -float(sum(t.sum() for t in token_logps)) / sum(len(t) for t in token_logps)


def answer_probability(model_dir: Path, rows: list[dict[str, str]]) -> float:
    """Mean probability of the whole answer: the expected exact-match rate of one sample."""
    token_logps = answer_token_logprobs(model_dir, rows)
    return sum(float(torch.exp(t.sum())) for t in token_logps) / len(rows)


def test_sft_writes_a_model_that_fits_the_answers_better(model_dir: Path, tmp_path: Path) -> None:
    train = pairs(96, seed=1)
    held_out = pairs(32, seed=2)
    out = tmp_path / "warm"
    done = sft(
        "--model", str(model_dir), "--data", str(write_jsonl(tmp_path / "d.jsonl", train)),
        "--out", str(out), "--epochs", "4", "--lr", "3e-3", "--batch-size", "16",
        "--warmup-updates", "6", "--schedule", "cosine", "--min-lr", "3e-4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # 6 updates per epoch: the warm-up ends with the first epoch, the cosine at its floor
    lrs = [float(lr) for lr in re.findall(r"sft epoch \d+: .*, lr (\S+)", done.stderr)]
    assert len(lrs) == 4 and lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4)
    assert lrs[0] > lrs[1] > lrs[2] > lrs[3]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["last_epoch_loss"] < report["first_epoch_loss"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    before, after = answer_nll(model_dir, held_out), answer_nll(out, held_out)
    assert after < before - 1.0, (before, after)  # nats per token, on prompts never trained


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "1+1="}', "needs a string `answer`"),
        ("[1, 2]", "needs a string `answer`"),
        ("nope", ":1: not JSON"),
    ],
)
def test_sft_bad_data_is_one_line(model_dir: Path, tmp_path: Path, line: str, match: str) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(line + "\n")
    done = sft("--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    assert match in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_sft_refuses_to_overwrite(model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", pairs(4, 0))
    done = sft("--model", str(model_dir), "--data", str(data), "--out", str(model_dir))
    assert done.returncode == 2 and "exists" in done.stderr


def test_sft_stops_at_its_target_accuracy_measured_on_held_aside_examples(
    model_dir: Path, tmp_path: Path
) -> None:
    train, aside = pairs(96, seed=1), pairs(24, seed=3)
    data = write_jsonl(tmp_path / "d.jsonl", train)
    eval_data = write_jsonl(tmp_path / "e.jsonl", aside)
    out = tmp_path / "warm"
    done = sft(
        "--model", str(model_dir), "--data", str(data), "--out", str(out), "--epochs", "30",
        "--lr", "3e-3", "--eval-data", str(eval_data), "--target-accuracy", "0.05",
        "--eval-every", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert 1 <= report["epochs"] < 30 and report["eval_accuracy"] >= 0.05
    # checked every 4 updates and at each epoch's end (6 updates of 16), and stopped at the
    # first check that reached the target, inside an epoch or at its end
    checks = [
        (int(update), float(accuracy))
        for update, accuracy in re.findall(
            r"sft update (\d+) \(.*?\): eval accuracy ([0-9.]+)", done.stderr
        )
    ]
    epoch_ends = range(6, 6 * 30 + 1, 6)
    assert [u for u, _ in checks] == sorted(
        {u for u in range(1, checks[-1][0] + 1) if u % 4 == 0 or u in epoch_ends}
    )
    assert all(a < 0.05 for _, a in checks[:-1]) and checks[-1][1] == pytest.approx(
        report["eval_accuracy"], abs=5e-5
    )
    assert report["updates"] == checks[-1][0]
    assert f"reached the target 0.0500 at update {checks[-1][0]}" in done.stderr
    # the accuracy is the model's: the written folder gives the same number under transformers
    assert report["eval_accuracy"] == pytest.approx(answer_probability(out, aside), rel=1e-3)
    assert f"eval accuracy {report['eval_accuracy']:.4f}" in done.stderr


def test_sft_target_needs_eval_data(model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", pairs(4, 0))
    done = sft(
        "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o"),
        "--target-accuracy", "0.5",
    )  # fmt: skip
    assert done.returncode == 2 and "--target-accuracy needs --eval-data" in done.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--min-lr", "0.01", "--lr", "0.001"), "--min-lr must be between 0 and --lr"),
        (("--warmup-updates", "-1"), "--warmup-updates must be >= 0"),
        (("--eval-every", "-1"), "--eval-every must be >= 0"),
    ],
)
def test_sft_schedule_out_of_range_is_one_line(
    model_dir: Path, tmp_path: Path, args: tuple[str, ...], match: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", pairs(4, 0))
    done = sft("--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o"), *args)
    assert done.returncode == 2 and match in done.stderr and len(done.stderr.splitlines()) == 1
