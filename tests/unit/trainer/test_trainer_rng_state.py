"""The checkpoint's RNG states are read without unpickling arbitrary objects: a file that
would need it (a planted one, or an older relayrl's) is not executed, only reported."""

from __future__ import annotations

import logging
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.trainer.checkpointing import _load_rng_state


class _Planted:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/relayrl-planted-rng-ran",))


def test_plain_states_round_trip_and_a_file_needing_unpickling_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = tmp_path / "plain.pt"
    state = {"python": [3, torch.tensor(random.getstate()[1]), None], "numpy": ["MT19937", 1]}
    torch.save(state, plain)
    loaded = _load_rng_state(plain)
    assert loaded is not None and loaded["numpy"] == ["MT19937", 1]

    planted = tmp_path / "planted.pt"
    torch.save({"numpy": np.random.get_state(), "x": _Planted()}, planted, pickle_module=pickle)
    Path("/tmp/relayrl-planted-rng-ran").unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING):
        assert _load_rng_state(planted) is None
    assert not Path("/tmp/relayrl-planted-rng-ran").exists()
    assert "needs unsafe unpickling" in caplog.text
