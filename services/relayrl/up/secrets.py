"""A local run's credentials: `relayrl up` turns authentication on between its services with
tokens made for that run, so that another user's process on the same machine (or anything
that can reach a loopback port) cannot publish weights, pause the gateway or stop the trainer.

`<run>/secrets/` (mode 0700) holds one token file per caller (mode 0600): the trainer,
weight-sync and the gateway call each other with their own, `relayrl up` itself (its
progress, `relayrl up status`) calls as the operator, and `agent.token` opens agent sessions
over gRPC. Every service checks callers against
`tokens.yaml`, which holds only the tokens' sha256 digests. What each role may call is
relayrl.core.access's table. Engines get a token per weight load from weight-sync. The run's
Redis asks for `redis.password`, which the services get in `RELAYRL_REDIS_PASSWORD`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import quote

import yaml

from relayrl.core.access import AGENT, GATEWAY, OPERATOR, TRAINER, WEIGHTSYNC
from relayrl.core.atomic import atomic_write_text
from relayrl.core.grpc_client import ClientIdentity
from relayrl.core.interceptors import token_digest
from relayrl.stack import Identities

PRINCIPALS = (TRAINER, WEIGHTSYNC, GATEWAY, OPERATOR, AGENT)
SECRETS_DIR = "secrets"
TOKENS_FILE = "tokens.yaml"
REDIS_PASSWORD_FILE = "redis.password"
REDIS_PASSWORD_ENV = "RELAYRL_REDIS_PASSWORD"
"""How the services of a run get its Redis password (`tq.password_env`)."""


def token_path(run_dir: Path, principal: str) -> Path:
    return run_dir / SECRETS_DIR / f"{principal}.token"


def run_identities(run_dir: Path) -> Identities:
    """The run's identities (the files may not exist yet: see `ensure_run_secrets`)."""
    return Identities(
        tokens_file=run_dir / SECRETS_DIR / TOKENS_FILE,
        token_files={p: token_path(run_dir, p) for p in PRINCIPALS},
    )


def ensure_run_secrets(run_dir: Path) -> Identities:
    """Makes the run's tokens unless they exist (a resumed run keeps its own)."""
    identities = run_identities(run_dir)
    files = [
        identities.tokens_file,
        *identities.token_files.values(),
        _redis_password_path(run_dir),
    ]
    if all(p.exists() for p in files):
        return identities
    directory = run_dir / SECRETS_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    digests = {}
    for principal, path in identities.token_files.items():
        token = secrets.token_urlsafe(32)
        _write_private(path, token + "\n")
        digests[principal] = token_digest(token)
    _write_private(identities.tokens_file, yaml.safe_dump(digests, sort_keys=True))
    _write_private(_redis_password_path(run_dir), secrets.token_urlsafe(32) + "\n")
    return identities


def _redis_password_path(run_dir: Path) -> Path:
    return run_dir / SECRETS_DIR / REDIS_PASSWORD_FILE


def redis_password(run_dir: Path) -> str | None:
    """The run's Redis password (None: a run without authentication)."""
    path = _redis_password_path(run_dir)
    return path.read_text(encoding="utf-8").strip() if path.exists() else None


def with_redis_password(url: str, run_dir: Path) -> str:
    """`url` (the run's Redis, as stack.json names it) with the run's password in it."""
    password = redis_password(run_dir)
    if password is None:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://:{quote(password, safe='')}@{rest}"


def operator_identity(run_dir: Path) -> ClientIdentity:
    """How `relayrl up` and its tools call the run's services (anonymous when the run was
    started with `security.authenticate: false`)."""
    path = token_path(run_dir, OPERATOR)
    if not path.exists():
        return ClientIdentity()
    return ClientIdentity(token=path.read_text(encoding="utf-8").strip())


def _write_private(path: Path, text: str) -> None:
    """Writes `text` to a file only its owner can read, replacing it whole."""
    atomic_write_text(path, text, permissions=0o600)
