"""Generate Python code from `protos/` and refuse to run with stale generated code.

The generated `_pb2`, `_pb2_grpc` and `.pyi` files are build outputs (never committed, never
hand-edited). `generate` writes them together with GENERATED_FROM, a digest of every `.proto`
source; `verify` (called when `relayrl.proto` is imported from a source checkout) compares that
digest with the sources on disk, so a checkout whose protos changed since the last
`make protos` fails at import time instead of running against an old contract.

    python -m relayrl.core.protogen generate   # what `make protos` runs
    python -m relayrl.core.protogen check      # compile every proto to a scratch dir
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "proto"
REPO_ROOT = PACKAGE_DIR.parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
STAMP = PACKAGE_DIR / "GENERATED_FROM"


class StaleProtosError(ImportError):
    """The generated protobuf code is missing or older than the `.proto` sources."""


def proto_sources(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(root.rglob("*.proto"))


def sources_digest(root: Path = PROTO_ROOT) -> str:
    digest = hashlib.sha256()
    for path in proto_sources(root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _protoc(out_dir: Path, sources: list[Path]) -> None:
    # Imported here: grpc_tools is a build-time dependency, not needed to use the code.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(s) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def generate() -> None:
    sources = proto_sources()
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    for stale in PACKAGE_DIR.rglob("*_pb2*.py*"):
        stale.unlink()
    _protoc(PACKAGE_DIR.parents[1], sources)
    for source in sources:
        # Every directory between relayrl/proto and the generated module is a regular package,
        # so setuptools and type checkers see it.
        package = PACKAGE_DIR.parents[1] / source.relative_to(PROTO_ROOT).parent
        while package != PACKAGE_DIR:
            (package / "__init__.py").touch()
            package = package.parent
    STAMP.write_text(sources_digest() + "\n")
    print(f"protogen: generated {len(sources)} protos into {PACKAGE_DIR}")


def check() -> None:
    """Compile every proto into a scratch directory (lint: the contracts compile)."""
    with tempfile.TemporaryDirectory() as scratch:
        _protoc(Path(scratch), proto_sources())
    print(f"protogen: {len(proto_sources())} protos compile")


def verify() -> None:
    """Raise StaleProtosError when generated code does not match the sources in this checkout."""
    if not PROTO_ROOT.is_dir():
        return  # an installed wheel: generated at build time, no sources to compare with
    if not STAMP.exists():
        raise StaleProtosError("generated protobuf code is missing: run `make protos`")
    if STAMP.read_text().strip() != sources_digest():
        raise StaleProtosError(
            "generated protobuf code is older than protos/: run `make protos` to regenerate it"
        )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    commands = {"generate": generate, "check": check}
    if len(args) != 1 or args[0] not in commands:
        raise SystemExit("usage: python -m relayrl.core.protogen generate|check")
    commands[args[0]]()


if __name__ == "__main__":
    main()
