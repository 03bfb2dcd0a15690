"""The request weight-sync sends every worker of a replica to receive one version (the worker
extension's `relayrl_receive`), and its JSON form: weight-sync builds a `ReceiveRequest`, the
engine's worker parses it back with `from_json`, which says what is wrong with a request it
cannot use instead of failing on a missing key halfway through a load.

    {"transport": "torch_distributed", "target": "weightsync:50051", "transfer_id": "v3-1a2b",
     "plan_digest": "...", "replica_id": "engine-0", "timeout_s": 300.0,
     "spec": "<TransportSpec JSON>", "receiver_rank_base": 2, "bucket_sha256": ["...", ...]}

The last three keys go with a broadcast data plane only (`spec` is the attempt's
`TransportSpec`); the gRPC pull needs none of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Final

from relayrl.dataplane.transports.base import TransportSpec

INITIAL_WEIGHTS: Final = ""
"""What a worker holds before any load (its `relayrl_ping` answers it): the weights it started
from, which are the trainer's version 0."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ReceiveRequest:
    """What one replica's workers receive; ValueError (naming the field) when it cannot work."""

    target: str
    """gRPC target of the weight-sync service: the plan comes from it (over grpc, the buckets
    too)."""
    transfer_id: str
    plan_digest: str
    """What the plan must hash to (`relayrl.dataplane.plan.plan_digest`); a worker refuses to
    load any other plan."""
    transport: str = "grpc"
    """The data plane: a key of `relayrl.dataplane.receiver.DATA_PLANES`."""
    replica_id: str = ""
    timeout_s: float = 300.0
    """Deadline of the whole receive."""
    spec: TransportSpec | None = None
    """Broadcast data planes: the attempt's TransportSpec (its type is `transport`)."""
    receiver_rank_base: int | None = None
    """Broadcast data planes: the receiver rank of the replica's first worker; each worker adds
    its own rank."""
    bucket_sha256: tuple[str, ...] = ()
    """Broadcast data planes: what each bucket must hash to, in plan order."""
    token: str = ""
    """The bearer token the workers present to weight-sync (minted for this transfer: it
    lets them read the plan and pull the buckets, nothing else, until the load ends)."""
    tls: bool = False
    """Weight-sync serves TLS: the workers dial it with the CA of their own engine config
    (`weightsync_tls`), never with anything the request carries."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_sha256, list):
            object.__setattr__(self, "bucket_sha256", tuple(self.bucket_sha256))
        for name in ("target", "transfer_id", "plan_digest", "transport"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.replica_id, str):
            raise ValueError(f"replica_id must be a string, got {self.replica_id!r}")
        if not isinstance(self.token, str):
            raise ValueError("token must be a string")
        if not isinstance(self.tls, bool):
            raise ValueError(f"tls must be true or false, got {self.tls!r}")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if self.spec is None:
            if self.receiver_rank_base is not None or self.bucket_sha256:
                raise ValueError("receiver_rank_base and bucket_sha256 go with a spec")
            return
        if self.spec.type != self.transport:
            raise ValueError(
                f"the spec is for {self.spec.type!r} but the transport is {self.transport!r}"
            )
        if not _is_int(self.receiver_rank_base) or self.receiver_rank_base < 0:  # type: ignore[operator]
            raise ValueError(
                f"receiver_rank_base must be an integer >= 0 with a spec, got "
                f"{self.receiver_rank_base!r}"
            )
        if not isinstance(self.bucket_sha256, tuple) or not all(
            isinstance(digest, str) for digest in self.bucket_sha256
        ):
            raise ValueError("bucket_sha256 must be a list of hex digests")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (a broadcast's fields only with a spec)."""
        fields: dict[str, Any] = {
            "transport": self.transport,
            "target": self.target,
            "transfer_id": self.transfer_id,
            "plan_digest": self.plan_digest,
            "replica_id": self.replica_id,
            "timeout_s": self.timeout_s,
        }
        if self.token:
            fields["token"] = self.token
        if self.tls:
            fields["tls"] = True
        if self.spec is not None:
            fields["spec"] = self.spec.to_json()
            fields["receiver_rank_base"] = self.receiver_rank_base
            fields["bucket_sha256"] = list(self.bucket_sha256)
        return fields

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> ReceiveRequest:
        if not isinstance(fields, Mapping):
            raise ValueError(f"a receive request is a JSON object, got {type(fields).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown receive request fields {unknown}: known are {sorted(known)}")
        missing = [name for name in ("target", "transfer_id", "plan_digest") if name not in fields]
        if missing:
            raise ValueError(f"a receive request needs {', '.join(missing)}")
        values = dict(fields)
        if values.get("spec") is not None:
            if not isinstance(values["spec"], str):
                raise ValueError("spec must be a TransportSpec as a JSON string")
            try:
                values["spec"] = TransportSpec.from_json(values["spec"])
            except ValueError as exc:
                raise ValueError(f"spec: {exc}") from None
        if isinstance(values.get("bucket_sha256"), list):
            values["bucket_sha256"] = tuple(values["bucket_sha256"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> ReceiveRequest:
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"a receive request must be JSON: {exc}") from None
        return cls.from_dict(fields)
