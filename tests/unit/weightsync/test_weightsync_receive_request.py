"""The coordinator -> worker request (`relayrl_receive`) as a typed object: its JSON form is
what workers have always read, a worker refuses a request it cannot use with an error that names
the field, and every data plane weight-sync can be configured with is an entry of the one
table the receiving end picks from."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from relayrl.core.config import TlsClientConfig
from relayrl.dataplane.data_planes import DATA_PLANES
from relayrl.dataplane.request import ReceiveRequest
from relayrl.dataplane.transports.base import TRANSPORTS, TransportSpec
from relayrl.weightsync.config import DataPlaneConfig

SPEC = TransportSpec(
    type="torch_distributed",
    transfer_id="v3-1a2b-1",
    num_senders=1,
    num_receivers=3,
    bucket_sizes=(4096, 17),
    rendezvous="10.0.0.5:29500",
)
PULL: dict[str, Any] = {
    "transport": "grpc",
    "target": "weightsync:50051",
    "transfer_id": "v3-1a2b",
    "plan_digest": "ab" * 32,
    "replica_id": "engine-0",
    "timeout_s": 300.0,
}


def test_a_pull_request_is_the_json_workers_read() -> None:
    request = ReceiveRequest.from_dict(PULL)
    assert request.to_dict() == PULL and list(request.to_dict()) == list(PULL)
    assert ReceiveRequest.from_json(request.to_json()) == request
    assert request.spec is None and request.receiver_rank_base is None


def test_a_broadcast_request_carries_its_spec_rank_and_checksums() -> None:
    request = ReceiveRequest(
        target="weightsync:50051",
        transfer_id="v3-1a2b",
        plan_digest="ab" * 32,
        transport="torch_distributed",
        spec=SPEC,
        receiver_rank_base=2,
        bucket_sha256=("0" * 64, "1" * 64),
    )
    wire = json.loads(request.to_json())
    assert TransportSpec.from_json(wire["spec"]) == SPEC
    assert wire["receiver_rank_base"] == 2 and wire["bucket_sha256"] == ["0" * 64, "1" * 64]
    assert ReceiveRequest.from_json(request.to_json()) == request


def test_over_tls_both_sides_must_agree_and_the_ca_is_the_engines_own(tmp_path: Path) -> None:
    from relayrl.dataplane.receiver import ReceiveError, _identity

    request = ReceiveRequest.from_dict({**PULL, "tls": True, "token": "t" * 20})
    assert (
        request.to_dict()["tls"] is True and "tls" not in ReceiveRequest.from_dict(PULL).to_dict()
    )
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"not a real CA, but a file")  # read when the channel is made, not here
    tls = TlsClientConfig(ca_file=ca)
    identity = _identity(request, tls)
    assert identity.credentials is not None and identity.token == "t" * 20
    with pytest.raises(ReceiveError, match="serves TLS, but this engine has no weightsync_tls"):
        _identity(request, None)
    plaintext = ReceiveRequest.from_dict(PULL)
    with pytest.raises(ReceiveError, match="advertised plaintext"):  # no silent downgrade
        _identity(plaintext, tls)
    assert _identity(plaintext, None).credentials is None
    with pytest.raises(ReceiveError, match="cannot read"):
        _identity(request, TlsClientConfig(ca_file=tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="tls must be true or false"):
        ReceiveRequest.from_dict({**PULL, "tls": "yes"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"transfer_id": None}, "a receive request needs transfer_id"),
        ({"plan_digest": ""}, "plan_digest must be a non-empty string"),
        ({"timeout_s": 0}, "timeout_s must be a finite number > 0"),
        ({"transfer": "v3"}, "unknown receive request fields ['transfer']"),
        ({"receiver_rank_base": 0}, "receiver_rank_base and bucket_sha256 go with a spec"),
        ({"spec": "{}"}, "spec: "),
        ({"spec": SPEC.to_json()}, "the spec is for 'torch_distributed' but the transport is"),
        (
            {"transport": "torch_distributed", "spec": SPEC.to_json()},
            "receiver_rank_base must be an integer >= 0 with a spec",
        ),
    ],
)
def test_a_request_a_worker_cannot_use_is_refused_naming_the_field(
    change: dict[str, Any], message: str
) -> None:
    fields = {**PULL, **change}
    fields = {key: value for key, value in fields.items() if value is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        ReceiveRequest.from_dict(fields)


def test_every_configurable_data_plane_is_an_entry_of_the_one_table() -> None:
    configurable = set(DataPlaneConfig.model_fields["transport"].annotation.__args__)
    assert set(DATA_PLANES) == configurable == {"grpc", "shm", *TRANSPORTS}
    assert not DATA_PLANES["grpc"].broadcast and not DATA_PLANES["shm"].broadcast
    assert all(DATA_PLANES[name].broadcast for name in TRANSPORTS)
