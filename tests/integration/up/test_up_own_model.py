"""`relayrl up` on a user's own model, data and reward, as a user runs it: SmolLM2-135M-Instruct (a
real pretrained model, imported from its GGUF file) trained for a few GRPO steps on a
verl-format dataset the test writes, rewarded by the user's own function, through the real
stack (redis-server, the four services, a vLLM engine), with every training setting at the
pretrained model's defaults (docs/defaults.md: learning rate, temperature, response budget,
the filter and its budget): only steps, batch sizes and the dataset are shrunk. And every
input mistake is one line and exit code 2 before anything starts. (A reasoning-gym task on the
tiny model runs in test_up_e2e.py, as its colocate_async run.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from relayrl.core.records import EvalRecord, TransferRecord, read_records
from relayrl.up.run_state import RunState
from relayrl_testkit.helpers import cli
from relayrl_testkit.helpers.real_model import smollm2_dir
from relayrl_testkit.helpers.up import (
    UpProcess,
    audit_queue,
    check_exactly_once,
    processes_of,
    sharing_cache,
    steps_logged,
)
from relayrl_testkit.word_problems import generate

pytestmark = pytest.mark.slow

# The user's defaults; shrunk: steps, groups per step, samples per group, held-out questions.
OWN_MODEL_RUN = {
    "train": {
        "steps": 1,
        "batch_groups": 1,
        "samples_per_prompt": 4,
        "checkpoint_interval_steps": 1,
    },
    "data": {"max_heldout": 4},
    "eval": {"interval_steps": 0},
    "engine": {"max_num_seqs": 16},
}
# The user's reward function, importable from PYTHONPATH as a user's package would be: 0.25
# or 0.75 by the parity of the reply's length (no rule scorer gives either, so the rewards show
# that it scored the rows; two values, so that a group has signal).
REWARDS = "def parity(item):\n    return 0.25 if len(item.response) % 2 else 0.75\n"


def verl_rows(n: int) -> list[dict]:
    """GSM8K-style rows in verl's layout (relayrl_testkit.word_problems), scored by the
    reward-service's gsm8k rule unless a function takes them."""
    train, heldout = generate(n - n // 4, n // 4, seed=5)
    return train + heldout


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_dir("fp32")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory, up_cache: Path) -> Path:
    return sharing_cache(tmp_path_factory.mktemp("runs"), up_cache)


def finished_run(up: UpProcess, timeout_s: float) -> tuple[Path, str]:
    try:
        assert up.wait(timeout_s) == 0, up.output()
        return up.run_dir, up.output()
    finally:
        up.stop()


def check_run(run_dir: Path, output: str, label: str, steps: int, heldout: int) -> None:
    """Versions committed in order, held-out evaluation before and after, the report written,
    every trained group consumed exactly once, nothing left running."""
    assert f"trained {label} for {steps} step{'s' * (steps != 1)}" in output, output
    assert "Traceback" not in output
    transfers = read_records(run_dir / "weightsync" / "transfers.jsonl", TransferRecord)
    committed = [t.version for t in transfers if t.state == "committed"]
    assert committed == list(range(1, steps + 1)), transfers
    evals = read_records(run_dir / "eval.jsonl", EvalRecord)
    kinds = ["warm_start", "first_update", "final"] if steps > 1 else ["warm_start", "final"]
    assert [e.kind for e in evals] == kinds, evals
    assert all(e.n == heldout for e in evals)
    assert evals[-1].version == steps
    assert (run_dir / "report.html").stat().st_size > 0
    assert {r.step for r in steps_logged(run_dir)} == set(range(steps))  # 0-based
    audit = audit_queue(run_dir)
    check_exactly_once(run_dir, audit)
    assert audit.statuses["GROUP_STATUS_FAILED"] == 0, audit.statuses
    assert processes_of(run_dir) == []


@pytest.mark.timeout(1200)
def test_a_real_pretrained_model_trains_on_a_verl_dataset(
    runs_dir: Path, smollm2: Path, tmp_path: Path
) -> None:
    rows = verl_rows(44)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    held = write_jsonl(tmp_path / "heldout.jsonl", rows[-4:])  # also in --data: never trained
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    reward = {"function": "my_rewards:parity", "data_sources": ["openai/gsm8k"]}
    up = UpProcess.start(
        runs_dir, {**OWN_MODEL_RUN, "reward": reward},
        "--model", str(smollm2), "--data", str(data), "--heldout", str(held),
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    run_dir, output = finished_run(up, 1100)
    check_run(run_dir, output, "dataset", steps=1, heldout=4)
    for record in steps_logged(run_dir):  # scored by the function: 0.25 and 0.75 only
        assert record.reward_mean not in (0.25, 0.75) and 0.25 < (record.reward_mean or 0) < 0.75
    final = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    assert final["accuracy"] == 1.0  # judged by the same function: a positive score
    # the pretrained model's defaults, printed and recorded
    assert "training settings for a pretrained model: lr 5e-06, cosine to 5e-07" in output
    training = RunState.read(run_dir).training
    assert training.temperature == 0.6 and training.max_tokens == 256
    trainer = yaml.safe_load((run_dir / "services/trainer/relayrl-trainer.yaml").read_text())
    assert trainer["optim"]["lr"] == 5e-6 and trainer["algorithm"]["temperature"] == 0.6
    assert f"model: {smollm2}" in output
    assert "warm start" not in output  # a pretrained model starts from itself
    assert "held-out accuracy (start, version 0)" in output
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["path"] == str(smollm2)
    assert config["data"]["train_files"] == [str(data)]
    assert config["data"]["heldout_files"] == [str(held)]
    # the prompts the trainer read are the dataset's training rows, never a held-out one
    prompts = (run_dir / "data" / "prompts.jsonl").read_text().splitlines()
    heldout = (run_dir / "data" / "heldout.jsonl").read_text().splitlines()
    assert (len(prompts), len(heldout)) == (40, 4)
    trained = {json.dumps(json.loads(p)["messages"]) for p in prompts}
    assert trained.isdisjoint(json.dumps(json.loads(h)["messages"]) for h in heldout)


# -- mistakes: one line, exit 2, nothing started -------------------------------------------------


def up_refuses(runs_dir: Path, *args: str | Path, text: str) -> None:
    result = cli.run("relayrl", "up", "--runs-dir", runs_dir, *args, timeout=300)
    cli.assert_one_line_error(result, "relayrl up", text)
    assert not any(runs_dir.glob("r-*")), "a run folder was made"


def model_without_chat_template(smollm2: Path, path: Path) -> Path:
    path.mkdir()
    for item in smollm2.iterdir():
        if item.name == "chat_template.jinja":
            continue
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config.pop("chat_template", None)
            (path / item.name).write_text(json.dumps(config))
        else:
            (path / item.name).symlink_to(item)
    return path


def test_input_mistakes_are_one_line_before_anything_starts(smollm2: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    rows = verl_rows(20)
    good = ("--data", write_jsonl(tmp_path / "good.jsonl", rows[:16]),
            "--heldout", write_jsonl(tmp_path / "good-heldout.jsonl", rows[16:]))  # fmt: skip
    up_refuses(runs, "--data", tmp_path / "missing.jsonl", text="missing.jsonl: no such file")
    bad = write_jsonl(tmp_path / "bad.jsonl", [*verl_rows(2), {"prompt": "hi"}])
    up_refuses(runs, "--data", bad, text="bad.jsonl row 3: `data_source` must be")
    unknown = write_jsonl(
        tmp_path / "unknown.jsonl", [dict(r, data_source="mine") for r in verl_rows(5)]
    )
    up_refuses(runs, "--data", unknown, text="data_source 'mine' has no scorer (5 rows")
    up_refuses(runs, "--task", "arith", *good, text="--task and --data")
    up_refuses(runs, "--task", "reasoning_gym:no_such_set", text="no dataset 'no_such_set'")
    up_refuses(runs, "--agent", "no-such-agent --fast", text="'no-such-agent' is not on PATH")
    up_refuses(runs, "--agent", "python3 missing_agent.py", text="no file missing_agent.py")
    up_refuses(runs, "--agent", "'unclosed", text='--agent "\'unclosed": No closing quotation')
    words = [dict(r, reward_model={"ground_truth": "forty-two"}) for r in verl_rows(8)]
    up_refuses(
        runs, "--data", write_jsonl(tmp_path / "words.jsonl", words),
        text="words.jsonl row 1: the openai/gsm8k rule cannot score this row: ground truth "
        "'forty-two' is not a number (8 of 8 rows)",
    )  # fmt: skip
    too_fast = write_yaml(tmp_path / "fast.yaml", {"train": {"lr": 4e-4}})
    up_refuses(
        runs, "--model", smollm2, *good, "--config", too_fast,
        text="train.lr 0.0004 is more than 10x the default for a pretrained model (5e-06",
    )  # fmt: skip
    too_long = write_yaml(tmp_path / "long.yaml", {"train": {"max_tokens": 2048}})
    up_refuses(
        runs, *good, "--config", too_long,
        text="train.max_tokens 2048 leaves no room for a prompt in engine.max_model_len 1024",
    )  # fmt: skip

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    up_refuses(runs, "--model", gpt2, *good, text="model_type 'gpt2' is not supported")
    plain = model_without_chat_template(smollm2, tmp_path / "plain")
    up_refuses(runs, "--model", plain, *good, text="the tokenizer has no chat template")
    long_rows = [dict(r, prompt=f"{i} " + "word " * 1500) for i, r in enumerate(verl_rows(7))]
    long = write_jsonl(tmp_path / "long.jsonl", long_rows[:5])
    long_held = write_jsonl(tmp_path / "long-heldout.jsonl", long_rows[5:])
    up_refuses(
        runs, "--model", smollm2, "--data", long, "--heldout", long_held,
        text="7 of 7 prompts do not fit engine.max_model_len 1024",
    )  # fmt: skip
    shutil.rmtree(runs, ignore_errors=True)
