"""torch_distributed (gloo): when a peer dies mid-transfer, every survivor fails within seconds,
not at the transfer's deadline, also where gloo alone would wait for that deadline: buckets big
enough to be in flight when the receiver dies, a receiver that relays gloo's broadcast tree,
and the sender (which hosts the rendezvous store) killed itself.

One runner process (`python -m relayrl_testkit.helpers.transport_roles`) plays every scenario, as in
`test_weightsync_transports.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

ROLES = "relayrl_testkit.helpers.transport_roles"
MIB = 1024 * 1024
TIMEOUT_S = 60.0  # the deadline nobody should wait for
FAST_S = 10.0  # "at once", with room for a loaded 2-core machine
LINGER_S = 3.0  # a failed role stays alive this long, as a trainer or engine would

# 8 MiB buckets: more than a socket takes at once, so bytes are in flight when a peer dies (with
# 1 MiB buckets gloo rarely gets caught mid-bucket). Before the lifelines, each of the first two
# left receiver 0 (sometimes sender 1) waiting for gloo's timeout in about half of the runs.
# Each kill comes early enough that no survivor can still get every bucket (a receiver
# prefetches two buckets ahead, so one killed late may already have let the others finish).
SCENARIOS: list[dict[str, Any]] = [
    {
        "name": "receiver_killed_at_first_bucket",
        "num_senders": 2,
        "num_receivers": 2,
        "bucket_sizes": [8 * MIB] * 6 + [777],
        "seed": 11,
        "kill_receiver": [1, 0],
    },
    {
        "name": "receiver_killed_mid_plan",
        "num_senders": 2,
        "num_receivers": 2,
        "bucket_sizes": [8 * MIB] * 8 + [777],
        "seed": 12,
        "kill_receiver": [1, 2],
    },
    {
        # One sender, four receivers (the weight-sync service's shape): gloo's broadcast tree
        # for five ranks relays through receiver 0 to receiver 2, so the sender never talks to
        # receiver 2 and receiver 2 waits on a dead peer.
        "name": "relay_receiver_killed",
        "num_senders": 1,
        "num_receivers": 4,
        "bucket_sizes": [8 * MIB] * 5 + [777],
        "seed": 13,
        "kill_receiver": [0, 1],
    },
    {
        "name": "sender_killed",
        "num_senders": 1,
        "num_receivers": 2,
        "bucket_sizes": [8 * MIB] * 5 + [777],
        "seed": 14,
        "kill_sender": [0, 2],
    },
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario, played once by one runner process."""
    scenarios = [
        scenario | {"type": "torch_distributed", "timeout_s": TIMEOUT_S, "linger_s": LINGER_S}
        for scenario in SCENARIOS
    ]
    stderr_path = tmp_path_factory.mktemp("gloo_liveness") / "roles.stderr"
    with stderr_path.open("w") as stderr:
        done = subprocess.run(
            [sys.executable, "-m", ROLES, json.dumps(scenarios)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=len(SCENARIOS) * (TIMEOUT_S + 40),  # a hang fails the tests, not the run
            check=False,
        )
    tail = stderr_path.read_text()[-3000:]
    assert done.returncode == 0, f"runner failed ({done.returncode}):\n{tail}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_everyone_else_failed_fast(results: dict[str, dict[str, Any]], killed: str) -> None:
    assert results[killed]["exitcode"] == -9
    killed_at = results[killed]["events"][-1]["at"]
    for name, result in results.items():
        if name == killed:
            continue
        assert not result["ok"], f"{name} should have failed"
        assert result["error_type"] == "TransportError", f"{name}: {result}"
        waited_s = result["at"] - killed_at
        assert waited_s < FAST_S, f"{name} failed {waited_s:.1f} s after the kill: {result}"
        if name.startswith("sender") != killed.startswith("sender"):  # a direct peer
            assert killed in result["error"], f"{name} does not say whom it lost: {result}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "killed"),
    [
        ("receiver_killed_at_first_bucket", "receiver 1"),
        ("receiver_killed_mid_plan", "receiver 1"),
        ("relay_receiver_killed", "receiver 0"),
    ],
)
def test_a_killed_receiver_fails_every_survivor_fast(
    report: dict[str, Any], scenario: str, killed: str
) -> None:
    assert_everyone_else_failed_fast(report[scenario]["roles"], killed)


@pytest.mark.slow
def test_a_killed_sender_fails_every_receiver_fast(report: dict[str, Any]) -> None:
    # Sender 0 also hosts the rendezvous store: no abort key can tell the receivers.
    assert_everyone_else_failed_fast(report["sender_killed"]["roles"], "sender 0")
