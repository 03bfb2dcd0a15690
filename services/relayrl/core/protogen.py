"""Generate Python code from `protos/` and refuse to run with stale generated code.

The generated `_pb2`, `_pb2_grpc` and `.pyi` files are build outputs (never committed, never
hand-edited). `generate` writes them together with GENERATED_FROM, a digest of every `.proto`
source; `verify` (called when `relayrl.proto` is imported from a source checkout) compares that
digest with the sources on disk, so a checkout whose protos changed since the last
`make protos` fails at import time instead of running against an old contract.

    python -m relayrl.core.protogen generate   # what `make protos` runs
    python -m relayrl.core.protogen check      # every proto compiles, and v1 only grew
    python -m relayrl.core.protogen snapshot   # record the v1 contract after adding to it

v1 contracts change additively only. protos/contract-v1.json records every message field,
enum value and RPC as released; `check` (run by `make lint` and the test suite) fails on a
removed, renumbered or retyped field, a removed enum value or a changed RPC signature.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "proto"
REPO_ROOT = PACKAGE_DIR.parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
STAMP = PACKAGE_DIR / "GENERATED_FROM"
CONTRACT = PROTO_ROOT / "contract-v1.json"


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


def _protoc(out_dir: Path, sources: list[Path], *extra: str) -> None:
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
        *extra,
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


def describe_contract() -> dict[str, dict[str, dict[str, list]]]:
    """Every message field, enum value and RPC of the protos, compiled from the sources."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as scratch:
        descriptor_set = Path(scratch) / "set.pb"
        _protoc(Path(scratch), proto_sources(), f"--descriptor_set_out={descriptor_set}")
        files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    contract: dict[str, dict[str, dict[str, list]]] = {"messages": {}, "enums": {}, "rpcs": {}}

    def add_message(prefix: str, message) -> None:
        name = f"{prefix}.{message.name}"
        contract["messages"][name] = {
            f.name: [f.number, f.type, f.label, f.type_name] for f in message.field
        }
        for nested in message.nested_type:
            if not nested.options.map_entry:
                add_message(name, nested)
        for enum in message.enum_type:
            contract["enums"][f"{name}.{enum.name}"] = {v.name: [v.number] for v in enum.value}

    for file in files:
        for message in file.message_type:
            add_message(file.package, message)
        for enum in file.enum_type:
            contract["enums"][f"{file.package}.{enum.name}"] = {
                v.name: [v.number] for v in enum.value
            }
        for service in file.service:
            contract["rpcs"][f"{file.package}.{service.name}"] = {
                m.name: [m.input_type, m.output_type, m.client_streaming, m.server_streaming]
                for m in service.method
            }
    return contract


def breaking_changes(released: dict, current: dict) -> list[str]:
    """What `current` removed or changed of `released` (additions are fine)."""
    problems = []
    for kind in ("messages", "enums", "rpcs"):
        for owner, members in released.get(kind, {}).items():
            now = current.get(kind, {}).get(owner)
            if now is None:
                problems.append(f"{kind[:-1]} {owner} was removed")
                continue
            for member, shape in members.items():
                if member not in now:
                    problems.append(f"{owner}.{member} was removed")
                elif list(now[member]) != list(shape):
                    problems.append(f"{owner}.{member} changed from {shape} to {now[member]}")
    return problems


def check() -> None:
    """Every proto compiles, and the v1 contract only grew since the last snapshot."""
    current = describe_contract()
    released = json.loads(CONTRACT.read_text()) if CONTRACT.exists() else {}
    problems = breaking_changes(released, current)
    if problems:
        raise SystemExit(
            "protogen: v1 contracts must change additively; breaking changes:\n  "
            + "\n  ".join(problems)
        )
    print(f"protogen: {len(proto_sources())} protos compile; v1 changes are additive")


def snapshot() -> None:
    """Records the current contract as released (after check() accepted the change)."""
    check()
    contract = describe_contract()
    # One line per member, so a contract change reads as a small diff.
    lines = ["{"]
    for k, kind in enumerate(sorted(contract)):
        lines.append(f" {json.dumps(kind)}: {{")
        owners = sorted(contract[kind])
        for o, owner in enumerate(owners):
            lines.append(f"  {json.dumps(owner)}: {{")
            members = sorted(contract[kind][owner].items())
            for m, (member, shape) in enumerate(members):
                comma = "," if m < len(members) - 1 else ""
                lines.append(f"   {json.dumps(member)}: {json.dumps(shape)}{comma}")
            lines.append("  }" + ("," if o < len(owners) - 1 else ""))
        lines.append(" }" + ("," if k < len(contract) - 1 else ""))
    lines.append("}")
    CONTRACT.write_text("\n".join(lines) + "\n")
    print(f"protogen: recorded the v1 contract in {CONTRACT}")


def verify(proto_root: Path = PROTO_ROOT, stamp: Path = STAMP) -> None:
    """Raise StaleProtosError when generated code does not match the sources in this checkout."""
    if not proto_root.is_dir():
        return  # an installed wheel: generated at build time, no sources to compare with
    if not stamp.exists():
        raise StaleProtosError("generated protobuf code is missing: run `make protos`")
    if stamp.read_text().strip() != sources_digest(proto_root):
        raise StaleProtosError(
            "generated protobuf code is older than protos/: run `make protos` to regenerate it"
        )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    commands = {"generate": generate, "check": check, "snapshot": snapshot}
    if len(args) != 1 or args[0] not in commands:
        raise SystemExit("usage: python -m relayrl.core.protogen generate|check|snapshot")
    commands[args[0]]()


if __name__ == "__main__":
    main()
