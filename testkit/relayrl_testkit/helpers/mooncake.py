"""Whether this machine can run the Mooncake data-plane tests: Mooncake binds every interface,
so its tests run in a private network namespace (`unshare -n`)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess


def mooncake_unavailable() -> str | None:
    """Why the Mooncake tests cannot run here (no root for a private network namespace), or
    None. A missing Mooncake package is not a reason: `make setup` installs it."""
    assert importlib.util.find_spec("mooncake") is not None, (
        "Mooncake is not installed: run `make setup` (it pins mooncake-transfer-engine-non-cuda "
        "and installs the Debian packages libibverbs1 librdmacm1)"
    )
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "the Mooncake tests need `unshare` and `ip` for a private network namespace"
    probe = subprocess.run(["unshare", "-n", "--", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"cannot make a private network namespace (unshare -n needs root): {probe.stderr!r}"
    return None
