"""Knocking on every gRPC method of running services with credentials that must be refused:
none, a token nobody was given, and the token of every principal whose role the method's
access table (relayrl.core.access) does not list. Used by the suite on a live `relayrl up` run
and by `make bench-trust`.

Requests are the method's empty message (a stream of one for client-streaming methods): a
refused call never reaches the handler, so what it would have done does not matter, and a
call that is wrongly accepted shows as any status other than UNAUTHENTICATED /
PERMISSION_DENIED."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from relayrl.core.access import ACCESS
from relayrl.core.interceptors import ANY_PRINCIPAL, AUTHORIZATION_KEY
from relayrl.up.stack_state import StackState

REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def service_descriptors() -> dict[str, ServiceDescriptor]:
    """The four services' proto descriptors, by the short name relayrl.core.access uses."""
    from relayrl.proto.reward.v1 import reward_pb2
    from relayrl.proto.rollout.v1 import rollout_pb2
    from relayrl.proto.trainer.v1 import trainer_pb2
    from relayrl.proto.weightsync.v1 import weightsync_pb2

    return {
        "reward": reward_pb2.DESCRIPTOR.services_by_name["RewardService"],
        "gateway": rollout_pb2.DESCRIPTOR.services_by_name["RolloutGateway"],
        "weightsync": weightsync_pb2.DESCRIPTOR.services_by_name["WeightSync"],
        "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
    }


def method_path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def call(
    channel: grpc.Channel,
    method: MethodDescriptor,
    request: Any,
    metadata: list[tuple[str, str]],
    timeout_s: float = 5.0,
) -> grpc.StatusCode:
    """The status of one call of `method` with `request` (a message, or for client-streaming
    methods a list of messages); streamed replies are read to the end."""
    request_class = message_factory.GetMessageClass(method.input_type)
    reply_class = message_factory.GetMessageClass(method.output_type)
    serialize = request_class.SerializeToString
    deserialize = reply_class.FromString
    path = method_path(method)
    try:
        if method.client_streaming and method.server_streaming:
            stub = channel.stream_stream(path, serialize, deserialize)
            for _ in stub(iter(request), metadata=metadata, timeout=timeout_s):
                pass
        elif method.client_streaming:
            channel.stream_unary(path, serialize, deserialize)(
                iter(request), metadata=metadata, timeout=timeout_s
            )
        elif method.server_streaming:
            stub = channel.unary_stream(path, serialize, deserialize)
            for _ in stub(request, metadata=metadata, timeout=timeout_s):
                pass
        else:
            channel.unary_unary(path, serialize, deserialize)(
                request, metadata=metadata, timeout=timeout_s
            )
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def empty_request(method: MethodDescriptor) -> Any:
    message = message_factory.GetMessageClass(method.input_type)()
    return [message] if method.client_streaming else message


@dataclass
class Knock:
    service: str
    method: str
    caller: str  # "anonymous", "unknown token" or a principal
    status: str

    @property
    def accepted(self) -> bool:
        return self.status not in {code.name for code in REFUSED}


@dataclass
class TrustReport:
    knocks: list[Knock] = field(default_factory=list)

    def of_kind(self, anonymous: bool) -> list[Knock]:
        unauthenticated = ("anonymous", "unknown token")
        return [k for k in self.knocks if (k.caller in unauthenticated) == anonymous]

    @property
    def unauth_accepted(self) -> list[Knock]:
        return [k for k in self.of_kind(anonymous=True) if k.accepted]

    @property
    def wrong_role_accepted(self) -> list[Knock]:
        return [k for k in self.of_kind(anonymous=False) if k.accepted]

    def methods_tried(self) -> list[str]:
        return sorted({f"{k.service}.{k.method}" for k in self.knocks})


def knock_everywhere(
    targets: Mapping[str, str],
    tokens: Mapping[str, str],
    roles_of: Mapping[str, frozenset[str]] | None = None,
) -> TrustReport:
    """Every method of every service in `targets` (short name -> host:port), called with no
    credentials, with an unknown token, and as each principal of `tokens` (principal ->
    token) that the method's access table does not allow (`roles_of`: a principal's roles,
    default its name). Only calls that must be refused are made."""
    roles_of = roles_of or {}
    report = TrustReport()
    descriptors = service_descriptors()
    for service, target in targets.items():
        policy = ACCESS[service]
        with grpc.insecure_channel(target) as channel:
            for method in descriptors[service].methods:
                allowed = policy.methods.get(method.name, frozenset())
                for caller, metadata in _wrong_callers(tokens, roles_of, allowed):
                    status = call(channel, method, empty_request(method), metadata)
                    report.knocks.append(Knock(service, method.name, caller, status.name))
    return report


def _wrong_callers(
    tokens: Mapping[str, str],
    roles_of: Mapping[str, frozenset[str]],
    allowed: frozenset[str],
) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    yield "anonymous", []
    yield "unknown token", [(AUTHORIZATION_KEY, f"Bearer {secrets.token_urlsafe(32)}")]
    if ANY_PRINCIPAL in allowed:
        return
    for principal, token in tokens.items():
        if not roles_of.get(principal, frozenset([principal])) & allowed:
            yield principal, [(AUTHORIZATION_KEY, f"Bearer {token}")]


def knock_on_run(run_dir: Path) -> TrustReport:
    """`knock_everywhere` on the services of a running `relayrl up` run, with its own tokens,
    and `knock_on_engine` on its engines."""
    from relayrl.up.secrets import PRINCIPALS, token_path

    children = StackState.read(run_dir).children
    targets = {name: str(children[name].target) for name in ACCESS}
    tokens = {p: token_path(run_dir, p).read_text().strip() for p in PRINCIPALS}
    report = knock_everywhere(targets, tokens)
    for name, child in children.items():
        if name.startswith("engine-"):
            report.knocks += knock_on_engine(str(child.url), tokens).knocks
    return report


ENGINE_PATHS = (
    ("POST", "/collective_rpc"), ("POST", "/update_weight_version"), ("POST", "/pause"),
    ("POST", "/resume"), ("POST", "/reset_prefix_cache"), ("GET", "/is_paused"),
    ("GET", "/weight_info"), ("POST", "/abort_requests"), ("POST", "/inference/v1/generate"),
    ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/sleep"),
    ("POST", "/tokenize"),
)  # fmt: skip
"""Routes of an engine (relayrl.engine.guard's table and some it serves to nobody)."""


def knock_on_engine(url: str, tokens: Mapping[str, str]) -> TrustReport:
    """Every route of ENGINE_PATHS called without credentials, with an unknown token and as
    each principal of `tokens` whose role the engine guard does not allow there; an answer
    other than 401/403 is an accepted call (recorded as its HTTP status)."""
    import urllib.error
    import urllib.request

    from relayrl.engine.guard import allowed_roles

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    report = TrustReport()
    for method, path in ENGINE_PATHS:
        allowed = allowed_roles(path)
        callers = [("anonymous", None), ("unknown token", secrets.token_urlsafe(32))]
        callers += [(p, t) for p, t in tokens.items() if p not in allowed]
        for caller, token in callers:
            headers = {"content-type": "application/json"}
            if token is not None:
                headers["authorization"] = f"Bearer {token}"
            body = b"{}" if method == "POST" else None
            request = urllib.request.Request(url + path, data=body, method=method, headers=headers)
            try:
                with opener.open(request, timeout=30) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            name = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED"}.get(status, f"HTTP_{status}")
            report.knocks.append(Knock("engine", path, caller, name))
    return report


def knock_on_sandbox(socket: Path, uids: list[int]) -> TrustReport:
    """A code request to relayrl-sandbox from each of `uids` (none of them allowed): any
    answer but PERMISSION_DENIED is an accepted call."""
    from relayrl_testkit.helpers.sandbox import submit_as

    report = TrustReport()
    request = {"item_id": "knock", "code": "x = 1", "tests": "assert x == 1"}
    for uid in uids:
        status = str(submit_as(uid, socket, request).get("status"))
        report.knocks.append(Knock("sandbox", f"submit as uid {uid}", "anonymous", status))
    return report
