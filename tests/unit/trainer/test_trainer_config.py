"""The trainer's config: the example stays valid, and the mistakes that would otherwise show
up hours into a run fail at start with one line that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.core.config import ConfigError, load_config
from relayrl.trainer.config import TrainerConfig, default_staleness_bound
from relayrl.trainer.modes import MODES, mode_for

EXAMPLE = Path(__file__).parents[3] / "deploy" / "config" / "trainer.example.yaml"


def load(tmp_path: Path, text: str) -> TrainerConfig:
    path = tmp_path / "trainer.yaml"
    path.write_text(text)
    return load_config(TrainerConfig, path, "RELAYRL_TRAINER", {})


def test_the_example_trainer_config_loads() -> None:
    config = load_config(TrainerConfig, EXAMPLE, "RELAYRL_TRAINER", {})
    assert config.algorithm.mode == "separate_async"
    assert config.algorithm.mini_batch_groups == 32
    assert config.staleness_threshold == 4
    assert len(config.algorithm.loss.rejection) == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "{algorithm: {mode: separate_async, parameter_sync_step: 2}, "
            "rollout_shape: {batch_groups: 7}}",
            "rollout_shape.batch_groups \\(7\\) must equal algorithm.parameter_sync_step \\(2\\)",
        ),
        ("algorithm: {mode: turbo}", "algorithm.mode: Input should be 'sync'"),
        ("algorithm: {loss: {clipp: 1}}", "algorithm.loss.clipp: Extra inputs"),
        ("rollout_shape: {eta: 2}", "rollout_shape.eta must be 0 in sync mode"),
        (
            "{algorithm: {mode: colocate_async}, rollout_shape: {eta: 2}}",
            "eta must be 0 or 1 in colocate_async",
        ),
        (
            "algorithm: {mode: colocate_async, parameter_sync_step: 2}",
            "parameter_sync_step must be 1 in colocate_async",
        ),
        ("algorithm: {eta: 1}", "algorithm.eta: moved to rollout_shape.eta"),
        ("algorithm: {train_batch_groups: 1}", "moved to rollout_shape.batch_groups"),
        ("data: {samples_per_prompt: 2}", "moved to rollout_shape.samples_per_prompt"),
        ("data: {max_tokens: 2}", "data.max_tokens: moved to rollout_shape.max_tokens"),
        ("optim: {lr: 0.001, min_lr: 0.01}", "min_lr"),
        ("publish: {type: s3}", "publish"),
        ("data: {run_id: 'has_underscore'}", "data.run_id"),
        (
            "research: {emulated_update_s: 0}",
            "research.emulated_update_s: Input should be greater than 0",
        ),
        ("emulated_update_s: 1", "emulated_update_s: renamed to research.emulated_update_s"),
        ("research_policy_lag: 1", "research_policy_lag: renamed to research.policy_lag"),
    ],
)
def test_bad_configs_fail_with_one_line(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as raised:
        load(tmp_path, text + "\n")
    assert "\n" not in str(raised.value)


def test_mini_batch_is_derived_from_k() -> None:
    config = TrainerConfig.model_validate(
        {
            "algorithm": {"mode": "separate_async", "parameter_sync_step": 3},
            "rollout_shape": {"batch_groups": 12},
        }
    )
    assert config.algorithm.mini_batch_groups == 4


@pytest.mark.parametrize(
    ("mode", "eta", "k", "bound"),
    [("sync", 0, 1, 1), ("colocate_async", 1, 1, 2), ("separate_async", 2, 4, 6)],
)
def test_default_staleness_bounds(mode: str, eta: int, k: int, bound: int) -> None:
    assert default_staleness_bound(mode, eta, k) == bound


def test_modes_come_from_one_table() -> None:
    assert set(MODES) == {"sync", "colocate_async", "separate_async"}
    with pytest.raises(ValueError, match="unknown trainer mode 'fast'; known: sync"):
        mode_for("fast")


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


def test_only_colocated_rollout_yields_the_devices() -> None:
    for name, expected in (
        ("sync", []),
        ("separate_async", []),
        ("colocate_async", ["pause", "resume"]),
    ):
        rollout = Recorder()
        mode = mode_for(name)
        mode.before_update(rollout)
        mode.after_publish(rollout)
        assert rollout.calls == expected, name


def test_groups_to_issue_run_eta_steps_ahead() -> None:
    mode = mode_for("separate_async")
    assert mode.groups_to_issue(step=0, batch_groups=8, eta=0) == 8
    assert mode.groups_to_issue(step=3, batch_groups=8, eta=2) == 48
