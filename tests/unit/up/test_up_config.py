"""`relayrl up`'s config: the annotated example is complete and shows the defaults; flags and
mistakes are reported in one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from relayrl.cli import main
from relayrl.core.config import load_config
from relayrl.up.config import UpConfig
from relayrl.up.workload import build_task

EXAMPLE = Path(__file__).parents[3] / "deploy" / "config" / "up.example.yaml"


def missing_keys(model: type[BaseModel], data: dict[str, Any], where: str = "") -> list[str]:
    missing = []
    for name, info in model.model_fields.items():
        if name not in data:
            missing.append(f"{where}{name}")
            continue
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            missing += missing_keys(annotation, data[name], f"{where}{name}.")
    return missing


def test_the_example_names_every_field_at_its_default() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert missing_keys(UpConfig, data) == []
    assert load_config(UpConfig, EXAMPLE, "RELAYRL_UP") == UpConfig()


def test_eta_defaults_by_mode_and_is_checked_against_it() -> None:
    assert UpConfig.model_validate({"train": {"mode": "sync"}}).train.effective_eta == 0
    assert UpConfig().train.effective_eta == 1
    with pytest.raises(ValueError, match="mode sync needs eta 0"):
        UpConfig.model_validate({"train": {"mode": "sync", "eta": 1}})
    with pytest.raises(ValueError, match="colocate_async allows eta 0 or 1"):
        UpConfig.model_validate({"train": {"mode": "colocate_async", "eta": 2}})


def test_task_knobs_are_checked_by_name_and_value() -> None:
    assert build_task(UpConfig.model_validate({"task": {"options": {"max_digits": 3}}}))
    with pytest.raises(ValueError, match="unknown knob\\(s\\) digits for arith"):
        build_task(UpConfig.model_validate({"task": {"options": {"digits": 3}}}))
    with pytest.raises(ValueError, match="max_digits must be in"):
        build_task(UpConfig.model_validate({"task": {"options": {"max_digits": 0}}}))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "sync", "--eta", "2"], "mode sync needs eta 0"),
        (["--steps", "0"], "train.steps: Input should be greater than or equal to 1"),
        (["--config", "/nonexistent.yaml"], "/nonexistent.yaml: file not found"),
        (["--resume", "/nonexistent-run"], "/nonexistent-run is not a relayrl run"),
    ],
)
def test_up_mistakes_are_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(["up", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_flags_override_the_file(tmp_path: Path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("train: {mode: sync, steps: 5}\ntask: {name: lookup}\n")
    assert main(["up", "--config", str(config), "--mode", "separate_async", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["mode"] == "separate_async" and printed["train"]["eta"] is None
    assert printed["train"]["steps"] == 5 and printed["task"]["name"] == "lookup"


def test_agent_flags_set_the_agent_section(capsys) -> None:
    argv = ["up", "--agent", "python a.py --serve", "--agent-serve", "--env-reward"]
    assert main([*argv, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["agent"]["command"] == ["python", "a.py", "--serve"]
    assert printed["agent"]["serve"] is True and printed["reward"]["env"] is True
    assert main(["up", "--env-reward", "--print-config"]) == 2
    assert "reward.env: only an agent reports" in capsys.readouterr().err


def test_status_without_a_run_says_how_to_start_one(tmp_path: Path, capsys) -> None:
    assert main(["status", "--runs-dir", str(tmp_path)]) == 2
    assert "no relayrl run in" in capsys.readouterr().err


# -- training defaults that follow the model (docs/defaults.md) -------------------------------


def test_the_tiny_model_and_a_pretrained_model_get_their_own_defaults() -> None:
    tiny = UpConfig().training
    assert (tiny.kind, tiny.lr, tiny.min_lr, tiny.warmup_steps) == ("tiny", 2e-4, 2e-5, 0)
    assert (tiny.temperature, tiny.max_tokens, tiny.micro_batch_size) == (0.7, 24, 16)
    assert tiny.micro_batch_tokens is None  # its activations are small at any length
    assert tiny.eval_sampled and tiny.clip_grad == 1.0 and tiny.kl_coef == 0.0
    own = UpConfig.model_validate(
        {"model": {"path": "/models/mine"}, "data": {"train_files": ["train.jsonl"]}}
    ).training
    assert (own.kind, own.lr, own.min_lr, own.warmup_steps) == ("pretrained", 5e-6, 5e-7, 5)
    assert (own.temperature, own.max_tokens, own.micro_batch_size) == (0.6, 256, 4)
    assert own.micro_batch_tokens == 256
    assert not own.eval_sampled
    assert own.describe() == (
        "training settings for a pretrained model: lr 5e-06 after a 5-step warm-up, cosine to "
        "5e-07, clip_grad 1, kl_coef 0, temperature 0.6, max_tokens 256, micro_batch_size 4, "
        "micro_batch_tokens 256 (all defaults)"
    )


def test_set_fields_win_and_are_named_and_a_short_run_keeps_its_steps_at_lr() -> None:
    config = UpConfig.model_validate(
        {
            "model": {"path": "/models/mine"},
            "train": {"steps": 8, "lr": 1e-5, "lr_schedule": "constant", "temperature": 1.0},
        }
    )
    training = config.training
    assert (training.lr, training.min_lr, training.temperature) == (1e-5, 1e-5, 1.0)
    assert training.warmup_steps == 2  # 5 by default, at most a quarter of 8 steps
    assert training.max_tokens == 24  # the built-in task's own budget comes first
    assert training.describe().endswith("(set in the config: lr, temperature)")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model": {"path": "/m"}, "train": {"lr": 4e-4}},
            "train.lr 0.0004 is more than 10x the default for a pretrained model (5e-06, "
            "docs/defaults.md); leave it null or lower it",
        ),
        ({"train": {"lr": 5e-3}}, "more than 10x the default for a tiny model (0.0002"),
        ({"train": {"lr": 1e-4, "min_lr": 2e-4}}, "train.min_lr (0.0002) must be <= lr (0.0001)"),
        (
            {"train": {"max_tokens": 1024}},
            "train.max_tokens 1024 leaves no room for a prompt in engine.max_model_len 1024",
        ),
    ],
)
def test_training_settings_that_do_not_fit_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        UpConfig.model_validate(config)
