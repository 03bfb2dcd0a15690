"""`research.policy_lag`: the trainer publishes the weights of `lag` versions ago under their
own number, so rollout is exactly that far behind; what a run leaves is its last version."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from relayrl.trainer import hf_mapping
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.publish import LaggedPublisher, WeightSyncPublisher, build_publisher


class WeightSync:
    """As strict as the service: a version is pushed once, and only above the committed one
    (unless it supersedes); holds what was pushed under each number."""

    def __init__(self) -> None:
        self.committed = 0
        self.pushed: dict[int, float] = {}

    def publish_tensors(self, version, tensors, *, supersede=False) -> dict[str, float]:
        if version <= self.committed and not supersede:
            raise AssertionError(f"version {version} is not above committed {self.committed}")
        (name, tensor), *_ = tensors
        assert name == "w"
        self.pushed[version] = float(tensor)
        self.committed = version
        return {"publish_bytes": 4.0}

    def publish(self, version, model, spec, *, supersede=False) -> dict[str, float]:
        return self.publish_tensors(version, [("w", model.clone())], supersede=supersede)

    def committed_version(self) -> int:
        return self.committed


@pytest.fixture
def export(monkeypatch):
    # The model is a 0-d tensor whose value is the version it was trained to.
    monkeypatch.setattr(hf_mapping, "export_hf_tensors", lambda model, spec: [("w", model.clone())])


def train(publisher: LaggedPublisher, first: int, last: int) -> list[int]:
    """Publishes versions first..last as the loop does; the versions rollout held after each."""
    held = []
    for version in range(first, last + 1):
        publisher.publish(version, torch.tensor(float(version)), None)
        held.append(publisher.rollout_version(version))
    return held


def test_rollout_stays_exactly_lag_versions_behind_with_the_weights_of_that_version(export):
    weightsync = WeightSync()
    publisher = LaggedPublisher(weightsync, lag=3)
    publisher.begin(0, torch.tensor(0.0), None)
    # the lag builds up from version 0, then holds at 3
    assert train(publisher, 1, 8) == [0, 0, 0, 1, 2, 3, 4, 5]
    assert weightsync.pushed == {v: float(v) for v in range(1, 6)}  # each under its own number
    publisher.finish(torch.tensor(8.0), None)
    assert publisher.rollout_version(8) == 8 and weightsync.pushed[8] == 8.0
    assert sorted(weightsync.pushed) == [1, 2, 3, 4, 5, 8]  # forward only, never twice
    publisher.finish(torch.tensor(8.0), None)  # nothing left to send
    assert sorted(weightsync.pushed) == [1, 2, 3, 4, 5, 8]


def test_a_resumed_trainer_puts_its_weights_back_and_builds_the_lag_up_again(export):
    weightsync = WeightSync()
    weightsync.committed = 4  # the crashed run had sent version 4 (lag 2 at step 6)
    publisher = LaggedPublisher(weightsync, lag=2)
    publisher.publish(5, torch.tensor(5.0), None, supersede=True)  # restore from step 5
    publisher.begin(5, torch.tensor(5.0), None)
    assert train(publisher, 6, 9) == [5, 5, 6, 7]
    assert weightsync.pushed == {5: 5.0, 6: 6.0, 7: 7.0}


def test_it_holds_at_most_lag_plus_one_copies(export):
    publisher = LaggedPublisher(WeightSync(), lag=2)
    publisher.begin(0, torch.tensor(0.0), None)
    train(publisher, 1, 20)
    assert len(publisher._held) <= 3


def test_the_lag_needs_weight_sync_and_a_real_update() -> None:
    with pytest.raises(ValidationError, match=r"set publish\.type weightsync"):
        TrainerConfig.model_validate({"research": {"policy_lag": 2}})
    with pytest.raises(ValidationError, match="needs the real update"):
        TrainerConfig.model_validate(
            {
                "research": {"policy_lag": 2, "emulated_update_s": 1.0},
                "publish": {"type": "weightsync", "target": "localhost:1"},
            }
        )
    config = TrainerConfig.model_validate(
        {"research": {"policy_lag": 2}, "publish": {"type": "weightsync", "target": "localhost:1"}}
    )
    assert isinstance(config.build_publisher(), LaggedPublisher)
    assert isinstance(
        build_publisher(config.publish, config.model.hf_dir), WeightSyncPublisher
    )  # 0: no wrapper
    with pytest.raises(ValueError, match="lag >= 1"):
        LaggedPublisher(WeightSync(), lag=0)
