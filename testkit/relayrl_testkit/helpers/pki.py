"""Throwaway certificate authorities and certificates made with openssl, for TLS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> None:
    """`<name>.crt` / `<name>.key`: a self-signed CA."""
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=directory,
    )  # fmt: skip


def make_cert(directory: Path, ca: str, name: str, san: str | None = None) -> None:
    """`<name>.crt` / `<name>.key` with CN `name`, signed by CA `ca` (a server certificate when
    `san` names its addresses, e.g. "DNS:localhost,IP:127.0.0.1")."""
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory,
    )  # fmt: skip
    extensions = directory / f"{name}.ext"
    extensions.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", extensions.name,
        cwd=directory,
    )  # fmt: skip


def mutual_tls_server(directory: Path, name: str = "server", ca: str = "ca") -> dict[str, object]:
    """A service's `grpc.tls` section for mutual TLS with `<name>.crt` signed by `ca`."""
    return {
        "cert_file": str(directory / f"{name}.crt"),
        "key_file": str(directory / f"{name}.key"),
        "client_ca_file": str(directory / f"{ca}.crt"),
        "require_client_cert": True,
    }
