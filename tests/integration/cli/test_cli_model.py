"""`relayrl model init`, run as a real process: it writes a loadable model, prints one summary
line, refuses to write over a directory without --force, and says what is wrong in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.models.tiny import weights_checksum
from relayrl_testkit.helpers import cli

pytestmark = pytest.mark.slow


def relayrl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return cli.run("relayrl", *args)


def assert_one_line_error(result: subprocess.CompletedProcess[str], text: str) -> None:
    cli.assert_one_line_error(result, "relayrl model", text)


def test_model_init_writes_a_model_and_prints_one_line(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    result = relayrl("model", "init", target)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    (line,) = result.stdout.splitlines()
    assert "509568 parameters" in line and "vocab 512" in line and line.endswith(str(target))
    checksum = weights_checksum(target / "model.safetensors")
    assert checksum[:12] in line
    assert relayrl("model", "init", tmp_path / "again").returncode == 0
    assert weights_checksum(tmp_path / "again" / "model.safetensors") == checksum
    for name in ("tokenizer.json", "tokenizer_config.json"):  # another process, same bytes
        assert (tmp_path / "again" / name).read_bytes() == (target / name).read_bytes()


def test_model_init_flags_set_the_sizes(tmp_path: Path) -> None:
    target = tmp_path / "m"
    result = relayrl(
        "model", "init", target, "--seed", "4", "--vocab-size", "1024",
        "--hidden-size", "256", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "1",
        "--intermediate-size", "512",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads((target / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (
        1024,
        256,
        2,
    )
    assert (config["num_key_value_heads"], config["intermediate_size"]) == (1, 512)
    assert len(json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]) == 1024 - 4


def test_model_init_refuses_a_non_empty_directory_without_force(tmp_path: Path) -> None:
    target = tmp_path / "m"
    assert relayrl("model", "init", target).returncode == 0
    before = weights_checksum(target / "model.safetensors")
    assert_one_line_error(relayrl("model", "init", target, "--seed", "1"), "pass --force")
    assert weights_checksum(target / "model.safetensors") == before
    forced = relayrl("model", "init", target, "--seed", "1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert weights_checksum(target / "model.safetensors") != before


def test_model_init_mistakes_are_one_line(tmp_path: Path) -> None:
    target = tmp_path / "m"
    assert_one_line_error(relayrl("model", "init", target, "--hidden-size", "64"), "head size")
    assert_one_line_error(relayrl("model", "init", target, "--vocab-size", "9"), "--vocab-size")
    assert_one_line_error(relayrl("model", "init", target, "--num-kv-heads", "3"), "num_kv_heads")
    (tmp_path / "file").write_text("")
    assert_one_line_error(relayrl("model", "init", tmp_path / "file"), "not a directory")
    assert not target.exists()
    usage = relayrl("model", "init", target, "--seed", "x")
    assert usage.returncode == 2 and "invalid int value" in usage.stderr


def test_model_init_help_imports_nothing_heavy() -> None:
    probe = (
        "import sys\n"
        "from relayrl.cli import main\n"
        "try:\n    main(['model', 'init', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('pydantic', 'torch', 'transformers', 'tokenizers')"
        " if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert "--vocab-size" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"
