"""The annotated example config in deploy/config stays valid."""

from __future__ import annotations

from pathlib import Path

from relayrl.core.config import load_config
from relayrl.weightsync.config import WeightSyncConfig

EXAMPLE = Path(__file__).parents[3] / "deploy" / "config" / "weightsync.example.yaml"


def test_the_example_weightsync_config_loads() -> None:
    config = load_config(WeightSyncConfig, EXAMPLE, "RELAYRL_WEIGHTSYNC", {})
    assert config.data_plane.transport == "torch_distributed"
    assert config.data_plane.rendezvous_port == 29600
    assert config.engines.urls == []  # the gateway registers the replicas
    assert config.state_dir is not None and config.gateway is not None
