"""The health-check command's argument handling: what it accepts, and the one-line usage errors
(exit 2) for what it does not. The checks against real servers are in
tests/integration/core/test_healthcheck.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.core import healthcheck
from relayrl.core.healthcheck import (
    GrpcCheck,
    HttpCheck,
    SandboxCheck,
    UsageError,
    parse_args,
    split_address,
)


def test_grpc_defaults_to_plaintext_overall_status() -> None:
    check = parse_args(["grpc", "127.0.0.1:50051"])
    assert check == GrpcCheck(host="127.0.0.1", port=50051, service="", timeout_s=1.0)
    assert check.target == "127.0.0.1:50051"


def test_ipv6_needs_brackets_and_keeps_them_in_the_target() -> None:
    assert split_address("[::1]:50051") == ("::1", 50051)
    assert parse_args(["grpc", "[::1]:9"]).target == "[::1]:9"
    with pytest.raises(UsageError, match="brackets"):
        split_address("::1:50051")


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:", ":50051", "h:0", "h:65536", "h:x"])
def test_a_bad_address_is_a_usage_error(address: str) -> None:
    with pytest.raises(UsageError, match="HOST:PORT"):
        split_address(address)


def test_tls_files_must_exist_and_come_in_pairs(tmp_path: Path) -> None:
    for name in ("ca.pem", "crt.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    ca, crt, key = (str(tmp_path / n) for n in ("ca.pem", "crt.pem", "key.pem"))
    check = parse_args(["grpc", "h:1", "--ca", ca, "--cert", crt, "--key", key, "--timeout-s", "2"])
    assert isinstance(check, GrpcCheck)
    assert (check.ca_file, check.cert_file, check.key_file) == (Path(ca), Path(crt), Path(key))
    assert check.timeout_s == 2.0
    with pytest.raises(UsageError, match="together"):
        parse_args(["grpc", "h:1", "--ca", ca, "--cert", crt])
    with pytest.raises(UsageError, match="need --ca"):
        parse_args(["grpc", "h:1", "--cert", crt, "--key", key])
    with pytest.raises(UsageError, match="need --ca"):
        parse_args(["grpc", "h:1", "--server-name", "svc"])
    with pytest.raises(UsageError, match="no such file"):
        parse_args(["grpc", "h:1", "--ca", str(tmp_path / "missing.pem")])


def test_sandbox_takes_a_socket_path() -> None:
    check = parse_args(["sandbox", "/run/relayrl-sandbox/sandbox.sock", "--timeout-s", "4"])
    assert check == SandboxCheck(socket="/run/relayrl-sandbox/sandbox.sock", timeout_s=4.0)


def test_http_takes_an_http_url() -> None:
    assert parse_args(["http", "http://127.0.0.1:8000/health"]) == HttpCheck(
        url="http://127.0.0.1:8000/health", timeout_s=1.0
    )
    with pytest.raises(UsageError, match="http:// or https://"):
        parse_args(["http", "127.0.0.1:8000/health"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "required"),
        (["ping", "h:1"], "invalid choice"),
        (["grpc"], "required"),
        (["grpc", "h:1", "--timeout-s", "0"], "positive"),
        (["grpc", "h:1", "--timeout-s", "soon"], "not a number"),
        (["http", "http://h/", "--service", "x"], "unrecognized"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert healthcheck.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.startswith("healthcheck: usage: ")


def test_the_command_imports_nothing_heavy() -> None:
    """Probes run it every few seconds: grpc and the stdlib, never torch, vLLM or pydantic."""
    code = (
        "import sys\n"
        "from relayrl.core.healthcheck import main\n"
        "assert main(['grpc', '127.0.0.1:9', '--timeout-s', '0.5']) == 1\n"
        "heavy = [m for m in ('torch', 'vllm', 'pydantic', 'numpy', 'yaml', 'relayrl.core.config')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
