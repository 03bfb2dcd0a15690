"""A partition under an established connection, for real: inside a private network namespace
(`unshare -rn`, root there and nowhere else) nftables drops every packet to and from one port,
so the peer's kernel answers nothing, not even the TCP keepalive probes that the kernel of a
peer that merely hangs would answer (`silent_peer.SilentListener` is that peer).

    unshare -rn python -m relayrl_testkit.helpers.partition engine-generate

runs one scenario and prints one JSON line, e.g. `{"error": "EngineUnavailable: ...",
"noticed_after_s": 2.1}`; `run_partitioned` does that from a test.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from typing import Any

from relayrl_testkit.helpers.silent_peer import SilentListener

TABLE = "relayrl_partition"


def partition_unavailable() -> str | None:
    """Why a partition cannot be made here (no unshare, nft or user namespaces), or None."""
    for tool in ("unshare", "ip", "nft"):
        if shutil.which(tool) is None:
            return f"a partition needs `{tool}`"
    probe = subprocess.run(
        ["unshare", "-rn", "nft", "add", "table", "inet", TABLE],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot drop packets in a private network namespace: {probe.stderr!r}"
    return None


def run_partitioned(scenario: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Runs `scenario` of this module in a private network namespace; its JSON answer."""
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-m", __name__, scenario],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scenario {scenario} failed ({done.returncode}): {done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def drop_port(port: int) -> None:
    """From now on every packet to or from `port` is dropped (within this namespace)."""
    for command in (
        f"add table inet {TABLE}",
        f"add chain inet {TABLE} out {{ type filter hook output priority 0 ; }}",
        f"add rule inet {TABLE} out tcp dport {port} drop",
        f"add rule inet {TABLE} out tcp sport {port} drop",
    ):
        subprocess.run(["nft", *command.split()], check=True)


async def engine_generate() -> dict[str, Any]:
    """A generation with a long deadline waits on an engine; the network between them goes;
    TCP keepalive (2 s here) must fail the call long before its deadline."""
    from relayrl.core.config import TcpKeepaliveConfig
    from relayrl.inference.client import EngineError, GenerateRequest, VllmEngineClient
    from relayrl.inference.config import EngineHttpConfig

    http = EngineHttpConfig(tcp_keepalive=TcpKeepaliveConfig(idle_s=1, interval_s=1, probes=1))
    with SilentListener() as engine:
        client = VllmEngineClient(f"http://{engine.address}", http=http, request_timeout_s=60)
        waiting = asyncio.ensure_future(client.generate(GenerateRequest("r-0", (1, 2, 3))))
        await asyncio.sleep(0.3)  # sent and acknowledged: the engine "computes"
        drop_port(engine.port)
        cut_at = time.monotonic()
        try:
            await waiting
            error = "none"
        except EngineError as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            await client.close()
        return {
            "error": error,
            "noticed_after_s": time.monotonic() - cut_at,
            "bound_s": http.tcp_keepalive.silent_peer_s,
        }


SCENARIOS = {"engine-generate": engine_generate}


def main(argv: list[str]) -> int:
    (scenario,) = argv
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    print(json.dumps(asyncio.run(SCENARIOS[scenario]())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
