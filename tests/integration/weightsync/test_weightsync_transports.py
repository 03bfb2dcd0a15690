"""The weight-sync data-plane transports, with every sender and receiver a real process.

For each transport (torch_distributed over gloo, Mooncake over TCP) one runner process
(`python -m relayrl_testkit.helpers.transport_roles`) plays every scenario below and reports
what each role saw; the tests read that report. Mooncake listens on every interface, so its
runner runs in a private network namespace (`unshare -n`, root here). The NCCL path of
torch_distributed needs GPUs and is not exercised here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from relayrl.dataplane.transports.base import (
    TRANSPORTS,
    TransportError,
    TransportSpec,
    check_bucket,
    open_sink,
)
from relayrl_testkit.helpers.mooncake import mooncake_unavailable

ROLES = "relayrl_testkit.helpers.transport_roles"
KIB = 1024
TIMEOUT_S = 20.0  # deadline of every wait in the scenarios that must fail fast
KILLED_TIMEOUT_S = 60.0  # a weight-sync service waits minutes; a death must not cost that
FAST_S = 10.0  # "at once", with room for a loaded 2-core machine
ABSENT_TIMEOUT_S = 3.0  # deadline of the scenario whose peer never shows up
LINGER_S = 3.0  # a failed role stays alive this long, as a trainer or engine would

# Odd numbers of buckets, each plan ending in a short bucket.
SCENARIOS: list[dict[str, Any]] = [
    {
        "name": "one_to_two",
        "num_senders": 1,
        "num_receivers": 2,
        "bucket_sizes": [256 * KIB] * 4 + [100_003],
        "timeout_s": TIMEOUT_S,
        "seed": 1,
    },
    {
        "name": "two_to_two",
        "num_senders": 2,
        "num_receivers": 2,
        "bucket_sizes": [256 * KIB] * 6 + [77_777],
        "timeout_s": TIMEOUT_S,
        "seed": 2,
        "repeat": 2,  # two transfers in a row; Mooncake roles keep their engine
    },
    {
        "name": "receiver_killed",
        "num_senders": 2,
        "num_receivers": 2,
        "bucket_sizes": [1024 * KIB] * 8 + [12_345],
        "timeout_s": KILLED_TIMEOUT_S,
        "seed": 3,
        "kill_receiver": [1, 2],
        "linger_s": LINGER_S,
    },
    {
        "name": "receiver_gives_up",
        "num_senders": 2,
        "num_receivers": 2,
        "bucket_sizes": [1024 * KIB] * 8 + [12_345],
        "timeout_s": TIMEOUT_S,
        "seed": 4,
        "raise_in_receiver": [1, 2],
        "linger_s": LINGER_S,
    },
    {
        "name": "wrong_size",
        "num_senders": 2,
        "num_receivers": 2,
        "bucket_sizes": [256 * KIB] * 4 + [777],
        "timeout_s": TIMEOUT_S,
        "seed": 5,
        "wrong_size": [1, 1],
    },
    {
        "name": "receiver_absent",
        "num_senders": 1,
        "num_receivers": 2,
        "bucket_sizes": [256 * KIB] * 2 + [777],
        "timeout_s": ABSENT_TIMEOUT_S,
        "seed": 6,
        "absent": [1],
    },
]


@pytest.fixture(scope="module", params=["torch_distributed", "mooncake"])
def report(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Every scenario of one transport, played once by one runner process."""
    transport: str = request.param
    scenarios = [scenario | {"type": transport} for scenario in SCENARIOS]
    command = [sys.executable, "-m", ROLES, json.dumps(scenarios)]
    if transport == "mooncake":
        if reason := mooncake_unavailable():
            pytest.skip(reason)
        command = ["unshare", "-n", "--", sys.executable, "-m", ROLES, "--netns", command[-1]]
    stderr_path = tmp_path_factory.mktemp(transport) / "roles.stderr"
    with stderr_path.open("w") as stderr:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=240, check=False
        )
    tail = stderr_path.read_text()[-3000:]
    assert done.returncode == 0, f"runner failed ({done.returncode}):\n{tail}"
    return {"transport": transport, **json.loads(done.stdout.strip().splitlines()[-1])}


def roles(report: dict[str, Any], scenario: str) -> dict[str, dict[str, Any]]:
    return report[scenario]["roles"]


def assert_transport_error(result: dict[str, Any], name: str) -> None:
    assert not result["ok"], f"{name} should have failed"
    assert result["error_type"] == "TransportError", f"{name}: {result}"
    assert result["boundary"] == "transport"
    assert "weight-sync transfer" in result["error"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["one_to_two", "two_to_two"])
def test_every_receiver_gets_every_bucket_bit_exact(report: dict[str, Any], scenario: str) -> None:
    expected = report[scenario]["expected_sha256"]
    for name, result in roles(report, scenario).items():
        assert result["ok"], f"{name}: {result.get('error')}"
        assert result["exitcode"] == 0
        if name.startswith("receiver"):
            assert result["sha256"] == expected, f"{name} got different bytes"


@pytest.mark.slow
def test_receiver_killed_mid_transfer_fails_the_others_fast(report: dict[str, Any]) -> None:
    results = roles(report, "receiver_killed")
    killed = results["receiver 1"]
    assert killed["exitcode"] == -9
    killed_at = killed["events"][-1]["at"]
    survivors = {name: r for name, r in results.items() if name != "receiver 1"}
    for name, result in survivors.items():
        assert_transport_error(result, name)
        # Every survivor, not just the first one. torch_distributed: gloo does not fail a
        # broadcast whose bytes were in flight to or from the dead peer until its timeout (the
        # transport's lifelines end it), and the abort key vanishes with a failing sender 0.
        waited_s = result["at"] - killed_at
        assert waited_s < FAST_S, f"{name} failed {waited_s:.1f} s after the kill: {result}"
    for s in range(2):  # the senders say which receiver they lost
        assert "receiver 1" in survivors[f"sender {s}"]["error"]
    # The senders stay alive after failing (as a trainer does): receiver 0 must not need their
    # exit to learn that the transfer is over.
    first_sender_failure = min(survivors[f"sender {s}"]["at"] for s in range(2))
    assert survivors["receiver 0"]["at"] < first_sender_failure + LINGER_S


@pytest.mark.slow
def test_receiver_that_gives_up_fails_the_others_fast(report: dict[str, Any]) -> None:
    results = roles(report, "receiver_gives_up")
    # On failure, say how receiver 1 ended (exit code, last events): once, in CI, it sent no
    # result at all, and the report alone did not tell a hang from a crash.
    assert results["receiver 1"]["error_type"] == "ValueError", results["receiver 1"]
    gave_up_at = results["receiver 1"]["events"][-1]["at"]
    for name in ("sender 0", "sender 1", "receiver 0"):
        assert_transport_error(results[name], name)
        # well before the deadline, and while receiver 1 is still alive (lingering)
        assert results[name]["at"] - gave_up_at < LINGER_S, f"{name} waited for its deadline"


@pytest.mark.slow
def test_wrong_bucket_size_fails_fast_everywhere(report: dict[str, Any]) -> None:
    results = roles(report, "wrong_size")
    culprit = results["sender 1"]
    assert_transport_error(culprit, "sender 1")
    assert "bucket 1" in culprit["error"]
    assert "has 262145 bytes but the plan says 262144" in culprit["error"]
    sent_at, failed_at = (
        next(e["at"] for e in culprit["events"] if e["event"] == event and e["index"] == 1)
        for event in ("sending", "send_failed")
    )
    # send() refuses the bucket before moving any byte (no waiting on peers: well under the
    # transfer's timeout even on a loaded machine)
    assert failed_at - sent_at < 5.0
    for name in ("sender 0", "receiver 0", "receiver 1"):
        assert_transport_error(results[name], name)
        assert results[name]["at"] - sent_at < TIMEOUT_S / 2, f"{name} waited for its deadline"


@pytest.mark.slow
def test_receiver_that_never_shows_up_fails_within_the_timeout(report: dict[str, Any]) -> None:
    results = roles(report, "receiver_absent")
    assert set(results) == {"sender 0", "receiver 0"}
    for name, result in results.items():
        assert_transport_error(result, name)
        assert "receiver 1" in result["error"], result["error"]
        # The deadline, plus setting up and tearing down (a Mooncake engine takes ~1 s to
        # stop) on a loaded 2-core machine: generous, since the point is "no hang".
        assert result["elapsed_s"] < ABSENT_TIMEOUT_S + 20.0


def test_spec_round_trips_through_json() -> None:
    spec = TransportSpec(
        type="mooncake",
        transfer_id="v7-0",
        num_senders=2,
        num_receivers=3,
        bucket_sizes=[4096, 4096, 17],
        rendezvous="10.0.0.5:29500",
        timeout_s=12.5,
    )
    again = TransportSpec.from_json(spec.to_json())
    assert again == spec
    assert again.bucket_sizes == (4096, 4096, 17)
    assert [list(spec.buckets_of(s)) for s in range(2)] == [[0, 2], [1]]
    assert spec.rendezvous_address == ("10.0.0.5", 29500)
    assert set(TRANSPORTS) == {"torch_distributed", "mooncake"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"type": "nccl"}, "transport type 'nccl' is unknown"),
        ({"bucket_sizes": []}, "non-empty"),
        ({"bucket_sizes": [10, 0]}, "bucket_sizes[1]"),
        ({"num_senders": 0}, "num_senders"),
        ({"rendezvous": "localhost"}, "host:port"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"device": "npu"}, "device"),
    ],
)
def test_spec_rejects_what_cannot_work(change: dict[str, Any], message: str) -> None:
    fields = {
        "type": "torch_distributed",
        "transfer_id": "t",
        "num_senders": 1,
        "num_receivers": 1,
        "bucket_sizes": [8],
        "rendezvous": "127.0.0.1:1",
    }
    with pytest.raises(ValueError) as caught:
        TransportSpec(**(fields | change))
    assert message in str(caught.value)


def test_spec_json_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown TransportSpec fields"):
        TransportSpec.from_json('{"type": "mooncake", "colour": "blue"}')


def test_bucket_that_does_not_match_the_plan_is_a_transport_error() -> None:
    spec = TransportSpec(
        type="torch_distributed",
        transfer_id="t9",
        num_senders=1,
        num_receivers=1,
        bucket_sizes=[8, 3],
        rendezvous="127.0.0.1:1",
    )
    check_bucket(spec, 1, torch.zeros(3, dtype=torch.uint8), "sender 0")
    with pytest.raises(TransportError, match=r"'t9', bucket 1, sender 0: .*4 bytes .* says 3"):
        check_bucket(spec, 1, torch.zeros(4, dtype=torch.uint8), "sender 0")
    with pytest.raises(TransportError, match="1-D uint8"):
        check_bucket(spec, 0, torch.zeros(2, dtype=torch.float32), "sender 0")


def test_sender_that_cannot_reach_the_rendezvous_fails_within_the_timeout() -> None:
    spec = TransportSpec(
        type="torch_distributed",
        transfer_id="nobody-home",
        num_senders=2,
        num_receivers=1,
        bucket_sizes=[8],
        rendezvous="127.0.0.1:9",  # the discard port: nothing listens there
        timeout_s=1.0,
    )
    with pytest.raises(TransportError, match="cannot reach the rendezvous store"):
        open_sink(spec, 1)
