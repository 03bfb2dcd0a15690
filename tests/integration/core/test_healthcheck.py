"""`python -m relayrl.core.healthcheck` (the containers' HEALTHCHECK and Kubernetes exec probes)
against a real relayrl-reward process: SERVING, stopped, TLS and mutual TLS, and its /metrics
over HTTP; plus a local HTTP server that answers 503 or too slowly."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from relayrl.core.service_process import ServiceProcess

REWARD_SERVICE = "relayrl.proto.reward.v1.RewardService"


def healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.core.healthcheck", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr, result.stderr


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = ServiceProcess("relayrl-reward", {}, tmp_path_factory.mktemp("reward")).start()
    try:
        yield service
    finally:
        service.stop()


def test_a_serving_service_is_healthy(reward: ServiceProcess) -> None:
    result = healthcheck("grpc", reward.target)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert healthcheck("grpc", reward.target, "--service", REWARD_SERVICE).returncode == 0


def test_an_unknown_service_name_is_unhealthy(reward: ServiceProcess) -> None:
    result = healthcheck("grpc", reward.target, "--service", "relayrl.nothing.v1.Nope")
    assert_one_line(result, 1, "does not know service 'relayrl.nothing.v1.Nope'")


def test_metrics_endpoint_over_http(reward: ServiceProcess) -> None:
    assert reward.metrics_port
    result = healthcheck("http", f"http://127.0.0.1:{reward.metrics_port}/metrics")
    assert result.returncode == 0, result.stderr


def test_a_stopped_service_is_unreachable(tmp_path: Path) -> None:
    service = ServiceProcess("relayrl-reward", {}, tmp_path).start()
    target, metrics_port = service.target, service.metrics_port
    assert healthcheck("grpc", target).returncode == 0
    service.stop()
    assert_one_line(healthcheck("grpc", target, "--timeout-s", "3"), 1, "unreachable")
    result = healthcheck("http", f"http://127.0.0.1:{metrics_port}/metrics")
    assert_one_line(result, 1, "unreachable")


def test_usage_mistakes_exit_2_without_a_traceback() -> None:
    assert_one_line(healthcheck(), 2, "usage:")
    assert_one_line(healthcheck("grpc", "localhost"), 2, "HOST:PORT")
    assert_one_line(healthcheck("grpc", "h:1", "--ca", "/nonexistent.pem"), 2, "no such file")
    assert_one_line(healthcheck("http", "localhost:8000/health"), 2, "http://")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(3)
        status = 503 if self.path == "/unhealthy" else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_status_decides(http_server: str) -> None:
    assert healthcheck("http", f"{http_server}/health").returncode == 0
    assert_one_line(healthcheck("http", f"{http_server}/unhealthy"), 1, "answered HTTP 503")
    result = healthcheck("http", f"{http_server}/slow", "--timeout-s", "0.5")
    assert_one_line(result, 1, "no answer within 0.5 s")


# --- TLS -----------------------------------------------------------------------------------------


def _write_cert(
    directory: Path,
    name: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    san: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    signer_cert, signer_key = issuer if issuer else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_cert.subject if signer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    ca = _write_cert(directory, "ca", None)
    _write_cert(directory, "rogue-ca", None)
    # Named only as the Service a cluster would call it: a probe of 127.0.0.1 needs --server-name.
    _write_cert(directory, "server", ca, [x509.DNSName("relayrl-reward.test")])
    _write_cert(directory, "local", ca, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    _write_cert(directory, "probe", ca)
    return directory


def _tls_reward(workdir: Path, pki: Path, server: str, require_client_cert: bool) -> ServiceProcess:
    tls: dict[str, Any] = {
        "cert_file": str(pki / f"{server}.crt"),
        "key_file": str(pki / f"{server}.key"),
    }
    if require_client_cert:
        tls |= {"client_ca_file": str(pki / "ca.crt"), "require_client_cert": True}
    return ServiceProcess("relayrl-reward", {"grpc": {"tls": tls}}, workdir).start()


def test_tls_with_the_ca(pki: Path, tmp_path: Path) -> None:
    service = _tls_reward(tmp_path, pki, "local", require_client_cert=False)
    try:
        assert healthcheck("grpc", service.target, "--ca", str(pki / "ca.crt")).returncode == 0
        wrong_ca = healthcheck("grpc", service.target, "--ca", str(pki / "rogue-ca.crt"))
        assert_one_line(wrong_ca, 1, "unreachable")
        plaintext = healthcheck("grpc", service.target, "--timeout-s", "3")
        assert plaintext.returncode == 1, plaintext.stderr
    finally:
        service.stop()


def test_mutual_tls_with_a_server_name_override(pki: Path, tmp_path: Path) -> None:
    service = _tls_reward(tmp_path, pki, "server", require_client_cert=True)
    ca = ["--ca", str(pki / "ca.crt")]
    client = ["--cert", str(pki / "probe.crt"), "--key", str(pki / "probe.key")]
    named = ["--server-name", "relayrl-reward.test"]
    try:
        assert healthcheck("grpc", service.target, *ca, *client, *named).returncode == 0
        # the certificate does not name 127.0.0.1
        assert_one_line(healthcheck("grpc", service.target, *ca, *client), 1, "unreachable")
        # no client certificate: the handshake fails
        assert_one_line(healthcheck("grpc", service.target, *ca, *named), 1, "unreachable")
    finally:
        service.stop()
