"""Bad input for every gRPC method, generated from the proto descriptors, and the verdict on
how the service took it.

Each case is the bytes of a request (a list of them for client-streaming methods), sent as
they are, so a case can be what no client library would produce:
- `empty`: the empty message;
- `random`: some fields set, each to a boundary or random value of its type (0, -1, the
  extremes of int64, NaN and infinities, empty, huge and non-UTF-8-looking strings, unknown enum
  numbers, nested messages, long repeated fields and maps);
- `huge`: one string, bytes or repeated field made large (up to a few MiB);
- `truncated`: a random message cut short;
- `garbage`: random bytes;
- `wrong_type`: a message of another method's request type.

A service took a case well when it answered with any status but UNKNOWN or INTERNAL (a handler
that raised) and is still healthy afterwards; UNAVAILABLE counts as a crash too, since a
loopback peer that stops answering has died or hung."""

from __future__ import annotations

import contextlib
import math
import random
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError

from relayrl_testkit.helpers.trust import method_path

CRASH_CODES = frozenset(
    {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
)
KINDS = ("empty", "random", "huge", "truncated", "garbage", "wrong_type")

_INTS = (0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 7, 10**9)
_UINTS = (0, 1, 2**32 - 1, 2**64 - 1, 10**9)
_FLOATS = (0.0, -0.0, 1.0, -1.0, 1e308, -1e308, 1e-308, math.inf, -math.inf, math.nan, 0.5)
_STRINGS = ("", " ", "a", "\x00", "../../etc/passwd", "é" * 64, "\ud7ff" * 3, "x" * 4096,
            "{not json", "v-1", "dns:///nowhere:1", "\n\r\t")  # fmt: skip
_CAP_DEPTH = 3


def _scalar(f: FieldDescriptor, rng: random.Random) -> Any:
    t = f.type
    if t in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return int(max(-(2**31), min(2**31 - 1, rng.choice(_INTS))))
    if t in (
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED64,
    ):
        return rng.choice(_INTS)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return min(2**32 - 1, rng.choice(_UINTS))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return rng.choice(_UINTS)
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        value = rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
        if t == FieldDescriptor.TYPE_FLOAT and math.isfinite(value) and abs(value) > 3e38:
            value = math.copysign(math.inf, value)
        return value
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.TYPE_STRING:
        return rng.choice(_STRINGS) if rng.random() < 0.7 else _random_text(rng, rng.randint(1, 64))
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 7, 64, 4096)))
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return rng.choice([*known, 99, -1])  # proto3 enums are open: unknown numbers parse
    raise AssertionError(f"unhandled field type {t}")


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(
        chr(rng.choice((rng.randint(32, 126), rng.randint(0x80, 0x2FFF)))) for _ in range(n)
    )


def random_message(descriptor: Descriptor, rng: random.Random, depth: int = 0) -> Any:
    """A message of `descriptor`'s type with a random subset of its fields set."""
    message = message_factory.GetMessageClass(descriptor)()
    for f in descriptor.fields:
        if rng.random() < 0.4:
            continue
        if f.containing_oneof is not None and message.WhichOneof(f.containing_oneof.name):
            continue
        _fill(message, f, rng, depth)
    return message


def _fill(message: Any, f: FieldDescriptor, rng: random.Random, depth: int) -> None:
    is_message = f.type == FieldDescriptor.TYPE_MESSAGE
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key_field, value_field = (
            f.message_type.fields_by_name["key"],
            f.message_type.fields_by_name["value"],
        )
        target = getattr(message, f.name)
        for _ in range(rng.choice((1, 3))):
            key = _scalar(key_field, rng)
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                if depth < _CAP_DEPTH:
                    target[key].CopyFrom(random_message(value_field.message_type, rng, depth + 1))
            else:
                target[key] = _scalar(value_field, rng)
        return
    if f.is_repeated:
        target = getattr(message, f.name)
        count = rng.choice((1, 2, 5))
        for _ in range(count):
            if is_message:
                if depth < _CAP_DEPTH:
                    target.add().CopyFrom(random_message(f.message_type, rng, depth + 1))
            else:
                target.append(_scalar(f, rng))
        return
    if is_message:
        if depth < _CAP_DEPTH:
            getattr(message, f.name).CopyFrom(random_message(f.message_type, rng, depth + 1))
        return
    setattr(message, f.name, _scalar(f, rng))


def _huge(descriptor: Descriptor, rng: random.Random) -> Any:
    message = random_message(descriptor, rng)
    candidates = [
        f
        for f in descriptor.fields
        if f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
        or (f.is_repeated and f.type != FieldDescriptor.TYPE_MESSAGE)
    ]
    if not candidates:
        return message
    f = rng.choice(candidates)
    size = rng.choice((64 * 1024, 1024 * 1024, 4 * 1024 * 1024))
    if f.is_repeated:
        target = getattr(message, f.name)
        del target[:]
        target.extend(_scalar(f, rng) for _ in range(min(size // 64, 20_000)))
    elif f.type == FieldDescriptor.TYPE_STRING:
        setattr(message, f.name, "x" * size)
    else:
        setattr(message, f.name, rng.randbytes(size))
    return message


@dataclass(frozen=True)
class Case:
    kind: str
    payloads: tuple[bytes, ...]  # one request, or the messages of a client stream


def cases(
    method: MethodDescriptor, rng: random.Random, n: int, others: Sequence[Descriptor]
) -> Iterator[Case]:
    """`n` cases for `method`, the kinds in turn; `others` are request types to send as
    `wrong_type`."""
    descriptor = method.input_type
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        if kind == "empty":
            data = b""
        elif kind == "random":
            data = random_message(descriptor, rng).SerializeToString()
        elif kind == "huge":
            data = _huge(descriptor, rng).SerializeToString()
        elif kind == "truncated":
            whole = random_message(descriptor, rng).SerializeToString() or struct.pack("B", 0x0A)
            data = whole[: rng.randint(0, max(0, len(whole) - 1))] + b"\x0a\xff"
        elif kind == "garbage":
            data = rng.randbytes(rng.randint(1, 256))
        else:
            data = random_message(rng.choice(list(others)), rng).SerializeToString()
        copies = rng.choice((1, 2, 3)) if method.client_streaming else 1
        yield Case(kind, (data,) * copies)


def send(
    channel: grpc.Channel,
    method: MethodDescriptor,
    case: Case,
    metadata: list[tuple[str, str]],
    timeout_s: float,
) -> grpc.StatusCode:
    """Sends `case` as raw bytes; the call's status (streamed replies are read through)."""
    path = method_path(method)
    raw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path, **raw)(
                iter(case.payloads), metadata=metadata, timeout=timeout_s
            ):
                pass
        elif method.client_streaming:
            channel.stream_unary(path, **raw)(
                iter(case.payloads), metadata=metadata, timeout=timeout_s
            )
        elif method.server_streaming:
            for _ in channel.unary_stream(path, **raw)(
                case.payloads[0], metadata=metadata, timeout=timeout_s
            ):
                pass
        else:
            channel.unary_unary(path, **raw)(case.payloads[0], metadata=metadata, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@dataclass
class FuzzReport:
    """What one service answered to its cases."""

    service: str
    cases: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)  # "Method kind: CODE"
    nonconforming: list[str] = field(default_factory=list)  # HTTP errors not in OpenAI's shape

    def record(self, method: str, case: Case, code: grpc.StatusCode) -> None:
        self.cases += 1
        self.statuses[code.name] = self.statuses.get(code.name, 0) + 1
        if code in CRASH_CODES:
            self.crashes.append(f"{method} {case.kind}: {code.name}")


def fuzz_service(
    target: str,
    methods: Sequence[MethodDescriptor],
    *,
    per_method: int,
    seed: int,
    metadata_for: Any = lambda method: [],
    skip: Any = lambda method, case: False,
    timeout_s: float = 2.0,
    service: str = "",
) -> FuzzReport:
    """`per_method` cases for each of `methods` of the service at `target`; `metadata_for
    (method)` gives the credentials of a caller allowed to call it, so the cases reach the
    handlers; `skip(method, case)` leaves out cases whose success would end the service on
    purpose (a trainer told to stop)."""
    rng = random.Random(seed)
    report = FuzzReport(service)
    others = [m.input_type for m in methods]
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        for method in methods:
            for case in cases(method, rng, per_method, others):
                if skip(method, case):
                    continue
                code = send(channel, method, case, metadata_for(method), timeout_s)
                report.record(method.name, case, code)
    return report


def decodes_as(method: MethodDescriptor, case: Case) -> Any | None:
    """The case's first request as `method`'s message, or None when it does not parse."""
    message = message_factory.GetMessageClass(method.input_type)()
    try:
        message.ParseFromString(case.payloads[0])
    except DecodeError:
        return None
    return message


# --- HTTP ------------------------------------------------------------------------------------

AGENT_ROUTES = (
    ("POST", "/sessions"),
    ("GET", "/sessions/{id}"),
    ("POST", "/sessions/{id}/close"),
    ("POST", "/sessions/{id}/abort"),
    ("POST", "/sessions/{id}/v1/chat/completions"),
    ("POST", "/sessions/{id}/v1/completions"),
    ("GET", "/sessions/{id}/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
)
"""The rollout-gateway's agent endpoint (relayrl.gateway.agent_http.router)."""

_SESSION_IDS = ("s-1", "", "%2e%2e", "x" * 300, "%00", "%C3%A9", "a%20b", "..", "-", "0", "%ff")
_JSON_VALUES: tuple[Any, ...] = (None, True, 0, -1, 2**63, 1e308, "", "x" * 10_000, [], {},
                                 [None], {"": None}, "NaN")  # fmt: skip
_OPENAI_FIELDS = ("model", "messages", "prompt", "max_tokens", "temperature", "top_p", "n",
                  "stream", "tools", "tool_choice", "logprobs", "stop", "seed", "metadata",
                  "data_source", "ground_truth", "extra_info", "partition", "env_reward",
                  "labels")  # fmt: skip


def _json_body(rng: random.Random) -> Any:
    body: dict[str, Any] = {}
    for name in rng.sample(_OPENAI_FIELDS, rng.randint(0, 6)):
        body[name] = rng.choice(_JSON_VALUES)
    if rng.random() < 0.5:
        role = rng.choice(("user", "system", "assistant", "tool", "x", 1, None))
        content = rng.choice(("hi", "", 5, None, [{"type": "text", "text": "hi"}], [{"x": 1}]))
        body["messages"] = [{"role": role, "content": content}] * rng.choice((1, 2, 50))
    return body


def http_cases(rng: random.Random, n: int, max_request_bytes: int) -> Iterator[tuple[str, bytes]]:
    """(kind, body) pairs for a JSON route."""
    import json

    kinds = ("empty", "not_json", "wrong_type", "random", "huge", "garbage")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "empty":
            body = b""
        elif kind == "not_json":
            body = rng.choice((b"{", b"[1,", b'{"a": }', b"\xff\xfe", b"null x"))
        elif kind == "wrong_type":
            body = json.dumps(rng.choice(_JSON_VALUES)).encode()
        elif kind == "random":
            body = json.dumps(_json_body(rng)).encode()
        elif kind == "huge":
            body = b'{"messages": "' + b"x" * (max_request_bytes + 1024) + b'"}'
        else:
            body = rng.randbytes(rng.randint(1, 512))
        yield kind, body


def fuzz_http(
    base_url: str,
    *,
    per_route: int,
    seed: int,
    max_request_bytes: int,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
) -> FuzzReport:
    """`per_route` requests to each of AGENT_ROUTES (random session ids, bodies of every kind
    for POST routes); a crash is an HTTP 500 or a connection that fails (the server died)."""
    import urllib.error
    import urllib.request

    rng = random.Random(seed)
    report = FuzzReport("gateway-http")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for method, route in AGENT_ROUTES:
        for kind, body in http_cases(rng, per_route, max_request_bytes):
            path = route.replace("{id}", rng.choice(_SESSION_IDS))
            request = urllib.request.Request(
                base_url + path,
                data=body if method == "POST" else None,
                method=method,
                headers={"content-type": "application/json", **(headers or {})},
            )
            try:
                with opener.open(request, timeout=timeout_s) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
                if not _openai_error(exc.read()):
                    report.nonconforming.append(f"{method} {route} {kind}: HTTP {status}")
            except (urllib.error.URLError, OSError) as exc:
                report.cases += 1
                report.crashes.append(f"{method} {route} {kind}: connection failed ({exc})")
                continue
            report.cases += 1
            report.statuses[str(status)] = report.statuses.get(str(status), 0) + 1
            if status >= 500 and status not in (502, 503, 504):
                report.crashes.append(f"{method} {route} {kind}: HTTP {status}")
    return report


def _openai_error(body: bytes) -> bool:
    """Whether `body` is an OpenAI-style error: {"error": {"message": str, "type": str, ...}}."""
    import json

    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


# -- the sandbox's unix socket (relayrl.reward.sandbox_service) --------------------------------

SANDBOX_STATUSES = frozenset(
    {"OK", "POLICY_FAIL", "INVALID_INPUT", "INFRA_ERROR", "PERMISSION_DENIED"}
)
_SANDBOX_VALUES: tuple[Any, ...] = (
    None, 0, -1, 2**63, 1.5, True, "", "x", [], {}, ["assert 1"], "\x00", "é" * 3,
)  # fmt: skip
_SANDBOX_CODE = ("x = 1", "", "def f(:", "raise SystemExit(3)", "import os\nos._exit(9)")
_SANDBOX_TESTS = (
    "assert x == 1",
    "",
    "assert (",
    '["assert 1"]',
    "[1, 2]",
    "def test_a():\n  pass",
)


def sandbox_cases(
    rng: random.Random, n: int, max_request_bytes: int
) -> Iterator[tuple[str, bytes]]:
    """(kind, bytes) pairs for the sandbox's one-JSON-line protocol."""
    import json

    kinds = ("empty", "no_newline", "not_json", "wrong_type", "random", "huge", "garbage")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "empty":
            data = rng.choice((b"", b"\n"))
        elif kind == "no_newline":
            data = b'{"item_id": "a", "code": "x = 1", "tests": "assert x"}'
        elif kind == "not_json":
            data = rng.choice((b"{", b"[1,", b'{"a": }', b"\xff\xfe", b"null x")) + b"\n"
        elif kind == "wrong_type":
            data = json.dumps(rng.choice(_SANDBOX_VALUES)).encode() + b"\n"
        elif kind == "random":
            request: dict[str, Any] = {}
            fields = (("item_id", ("a", "")), ("code", _SANDBOX_CODE), ("tests", _SANDBOX_TESTS))
            for name, texts in fields:
                if rng.random() < 0.95:  # mostly well-typed, so that some cases really run
                    request[name] = rng.choice(texts if rng.random() < 0.8 else _SANDBOX_VALUES)
            if rng.random() < 0.2:
                request[rng.choice(("ping", "uid", "time_limit_s"))] = rng.choice(_SANDBOX_VALUES)
            data = json.dumps(request).encode() + b"\n"
        elif kind == "huge":
            data = b'{"code": "' + b"x" * (max_request_bytes + 1024) + b'"}\n'
        else:
            data = rng.randbytes(rng.randint(1, 512)) + rng.choice((b"", b"\n"))
        yield kind, data


def fuzz_sandbox(
    socket_path: str, *, cases: int, seed: int, max_request_bytes: int, timeout_s: float = 30.0
) -> FuzzReport:
    """`cases` requests of every kind to the sandbox's socket, each on its own connection.
    Taken well: a JSON object with a known status, or the
    connection closed without an answer where there was no complete request line. A crash:
    anything else, or a connection refused (the service died)."""
    import json
    import socket

    rng = random.Random(seed)
    report = FuzzReport("sandbox")
    for kind, data in sandbox_cases(rng, cases, max_request_bytes):
        report.cases += 1
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout_s)
                sock.connect(socket_path)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(data)
                    if not data.endswith(b"\n"):
                        # no request line: say so (a complete one is answered while the
                        # connection stays open; closing it before the answer cancels)
                        sock.shutdown(socket.SHUT_WR)
                answer = sock.makefile("rb").readline(1 << 20)
        except OSError as exc:
            report.crashes.append(f"{kind}: {type(exc).__name__}: {exc}")
            continue
        if not answer:
            status = "closed"
            if data.endswith(b"\n") and len(data) > 1 and kind != "huge":
                report.crashes.append(f"{kind}: closed without an answer to {data[:80]!r}")
        else:
            try:
                reply = json.loads(answer)
                status = reply["status"] if isinstance(reply, dict) else "?"
            except (ValueError, KeyError):
                status = "?"
            if status not in SANDBOX_STATUSES:
                report.crashes.append(f"{kind}: answered {answer[:200]!r}")
        report.statuses[status] = report.statuses.get(status, 0) + 1
    return report
