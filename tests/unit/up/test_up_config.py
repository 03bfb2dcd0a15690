"""`relayrl up`'s config: the annotated example is complete and shows the defaults; flags and
mistakes are reported in one line."""

from __future__ import annotations

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
