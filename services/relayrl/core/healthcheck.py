"""A container health check: is this relayrl service (or vLLM engine) answering?

    python -m relayrl.core.healthcheck grpc HOST:PORT [--service NAME]
        [--ca FILE [--cert FILE --key FILE] [--server-name NAME]] [--timeout-s S]
    python -m relayrl.core.healthcheck http URL [--timeout-s S]
    python -m relayrl.core.healthcheck sandbox SOCKET [--timeout-s S]

`grpc` calls grpc.health.v1 Health/Check (the overall status, or NAME's): plaintext by
default, TLS when `--ca` is given, mutual TLS when `--cert` and `--key` are given too.
`--server-name` checks the server certificate against NAME instead of HOST (a pod probes
127.0.0.1 while its certificate names the Service). `http` GETs URL; any 2xx is healthy.
`sandbox` pings relayrl-sandbox on its unix socket (relayrl.reward.sandbox_service); healthy
when it answers OK.

Exit codes: 0 healthy (SERVING / 2xx); 1 not healthy or unreachable, with one line on stderr
saying why; 2 a usage mistake, one line on stderr. Docker HEALTHCHECKs and Kubernetes exec
probes run it every few seconds, so it imports grpc and the stdlib only (no torch, no vLLM,
nothing else of relayrl) and answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

PROG = "python -m relayrl.core.healthcheck"
EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
DEFAULT_TIMEOUT_S = 1.0


class UsageError(Exception):
    """A mistake in the command line; exits 2 with the message as one line."""


class Unhealthy(Exception):
    """The target answered badly or not at all; exits 1 with the message as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints a usage block first; a probe's log wants one line.
        raise UsageError(message)


@dataclass(frozen=True)
class GrpcCheck:
    host: str
    port: int
    service: str
    timeout_s: float
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

    @property
    def target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class HttpCheck:
    url: str
    timeout_s: float


@dataclass(frozen=True)
class SandboxCheck:
    socket: str
    timeout_s: float


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Exit 0 when the target is healthy, 1 when not.")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="{grpc,http,sandbox}")
    grpc_parser = kinds.add_parser(
        "grpc", help="grpc.health.v1 Check; healthy when SERVING", description=__doc__
    )
    grpc_parser.add_argument("address", metavar="HOST:PORT", help="e.g. 127.0.0.1:50051")
    grpc_parser.add_argument(
        "--service", default="", metavar="NAME", help="service to ask about (default: overall)"
    )
    grpc_parser.add_argument("--ca", metavar="FILE", help="PEM CA bundle: use TLS and trust it")
    grpc_parser.add_argument("--cert", metavar="FILE", help="PEM client certificate (mTLS)")
    grpc_parser.add_argument("--key", metavar="FILE", help="PEM key of --cert (mTLS)")
    grpc_parser.add_argument(
        "--server-name", metavar="NAME", help="name the server certificate must carry (TLS)"
    )
    http_parser = kinds.add_parser("http", help="GET URL; healthy on 2xx", description=__doc__)
    http_parser.add_argument("url", metavar="URL", help="e.g. http://127.0.0.1:8000/health")
    sandbox_parser = kinds.add_parser(
        "sandbox", help="ping relayrl-sandbox; healthy when it answers", description=__doc__
    )
    sandbox_parser.add_argument("socket", metavar="SOCKET", help="its unix socket's path")
    for sub in (grpc_parser, http_parser, sandbox_parser):
        sub.add_argument(
            "--timeout-s",
            type=_timeout,
            default=DEFAULT_TIMEOUT_S,
            metavar="S",
            help=f"give up after S seconds (default {DEFAULT_TIMEOUT_S:g})",
        )
    return parser


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); UsageError on anything else."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise UsageError(f"write an IPv6 address in brackets: [{host}]:{port_text}")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UsageError(f"expected HOST:PORT with a port in 1-65535, not {address!r}")
    return host, int(port_text)


def parse_args(argv: Sequence[str]) -> GrpcCheck | HttpCheck | SandboxCheck:
    """The check the command line asks for; UsageError on a mistake."""
    args = build_parser().parse_args(argv)
    if args.kind == "sandbox":
        return SandboxCheck(socket=args.socket, timeout_s=args.timeout_s)
    if args.kind == "http":
        if not args.url.lower().startswith(("http://", "https://")):
            raise UsageError(f"URL must start with http:// or https://, not {args.url!r}")
        return HttpCheck(url=args.url, timeout_s=args.timeout_s)
    host, port = split_address(args.address)
    if (args.cert is None) != (args.key is None):
        raise UsageError("give --cert and --key together (a client certificate and its key)")
    if args.ca is None and (args.cert is not None or args.server_name is not None):
        raise UsageError("--cert, --key and --server-name need --ca (they only apply to TLS)")
    files = {}
    for option in ("ca", "cert", "key"):
        name = getattr(args, option)
        if name is not None:
            if not Path(name).is_file():
                raise UsageError(f"--{option} {name}: no such file")
            files[f"{option}_file"] = Path(name)
    return GrpcCheck(
        host=host,
        port=port,
        service=args.service,
        timeout_s=args.timeout_s,
        server_name=args.server_name,
        **files,
    )


def check_grpc(check: GrpcCheck) -> str:
    """One Health/Check call; the status name when SERVING, else Unhealthy."""
    # gRPC's C core logs failed handshakes on stderr itself; the probe's one line says it all.
    # Set before grpc is imported, which reads it then; this process is only the probe.
    os.environ["GRPC_VERBOSITY"] = "NONE"
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # A probe asks this very pod: an http(s)_proxy in its environment must not reroute it.
    options: list[tuple[str, str | int]] = [("grpc.enable_http_proxy", 0)]
    if check.ca_file is None:
        channel = grpc.insecure_channel(check.target, options=options)
    else:
        try:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=check.ca_file.read_bytes(),
                private_key=check.key_file.read_bytes() if check.key_file else None,
                certificate_chain=check.cert_file.read_bytes() if check.cert_file else None,
            )
        except OSError as exc:
            raise UsageError(f"cannot read a TLS file: {exc}") from None
        if check.server_name:
            options.append(("grpc.ssl_target_name_override", check.server_name))
        channel = grpc.secure_channel(check.target, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=check.service), timeout=check.timeout_s
            )
        except grpc.RpcError as exc:
            raise Unhealthy(_describe_rpc_error(check, exc)) from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        raise Unhealthy(f"{_what(check)} is {status}")
    return status


def _what(check: GrpcCheck) -> str:
    return f"service {check.service!r} at {check.target}" if check.service else check.target


def _describe_rpc_error(check: GrpcCheck, exc: BaseException) -> str:
    import grpc

    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or ""
    details = " ".join(details.split())  # one line, whatever the C core said
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{check.target}: no health answer within {check.timeout_s:g} s"
    if code is grpc.StatusCode.UNAVAILABLE:
        return f"{check.target} unreachable: {details}"
    if code is grpc.StatusCode.NOT_FOUND:
        return f"{check.target} does not know service {check.service!r}"
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return f"{check.target} does not serve grpc.health.v1"
    name = code.name if code is not None else type(exc).__name__
    return f"{check.target} health check failed: {name}: {details}"


def check_http(check: HttpCheck) -> str:
    """One GET; `HTTP <code>` when 2xx, else Unhealthy."""
    import urllib.error
    import urllib.request

    # No proxies: the probe asks this very pod, whatever http_proxy its environment sets.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(check.url, timeout=check.timeout_s) as response:
            code = response.status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise Unhealthy(f"{check.url}: no answer within {check.timeout_s:g} s") from None
        raise Unhealthy(f"{check.url} unreachable: {reason}") from None
    if not 200 <= code < 300:
        raise Unhealthy(f"{check.url} answered HTTP {code}")
    return f"HTTP {code}"


def check_sandbox(check: SandboxCheck) -> str:
    """One ping on the sandbox's socket (its protocol: a JSON line each way)."""
    import json
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(check.timeout_s)
            sock.connect(check.socket)
            sock.sendall(b'{"ping": true}\n')
            answer = sock.makefile("rb").readline(65536)
    except TimeoutError:
        raise Unhealthy(f"{check.socket}: no answer within {check.timeout_s:g} s") from None
    except OSError as exc:
        raise Unhealthy(f"{check.socket} unreachable: {exc.strerror or exc}") from None
    try:
        reply = json.loads(answer)
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        raise Unhealthy(f"{check.socket} answered {answer[:200]!r}")
    return "OK"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        check = parse_args(sys.argv[1:] if argv is None else argv)
        if isinstance(check, HttpCheck):
            check_http(check)
        elif isinstance(check, SandboxCheck):
            check_sandbox(check)
        else:
            check_grpc(check)
    except UsageError as exc:
        print(f"healthcheck: usage: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Unhealthy as exc:
        print(f"healthcheck: unhealthy: {exc}", file=sys.stderr)
        return EXIT_UNHEALTHY
    return EXIT_HEALTHY


if __name__ == "__main__":
    sys.exit(main())
