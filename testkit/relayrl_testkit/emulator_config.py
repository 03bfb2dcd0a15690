"""Configuration and command line of the engine emulator (`python -m relayrl_testkit.emulator`).

Standard library only, so that `--help` and a mistyped option answer before the server's
imports (aiohttp, numpy, prometheus_client) load.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

PROG = "python -m relayrl_testkit.emulator"

DESCRIPTION = """\
An engine emulator: a LOAD GENERATOR FOR THE PIPELINE BENCHMARK ONLY, not an inference engine.
It speaks the subset of vLLM's HTTP API that relayrl uses (the scale-out generate endpoint, the
dev-mode pause/resume/weight-version endpoints, /collective_rpc with relayrl's worker-extension
methods), samples nothing, and makes the i-th arriving generate request last as long as episode
i of the simulator's episode model, at --time-scale wall seconds per simulated second; its
tokens are pseudo-random ids. Weight-sync versions are really received over the gRPC data plane
and checked, then discarded."""

QWEN2_VOCAB_SIZE = 151936


@dataclass(frozen=True)
class EmulatorConfig:
    """What one emulator process serves and how its requests are timed."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 0
    """Port to listen on; 0 picks a free one (see `ready_file`)."""
    ready_file: Path | None = None
    """Written atomically as JSON {"url", "pid"} once the server listens."""
    time_scale: float = 0.01
    """Wall seconds per simulated second: a 96 s episode takes 0.96 s at 0.01."""
    seed: int = 0
    """Seed of the episode stream: the i-th arriving generate request gets episode i."""
    sync_time_s: float = 10.0
    """Simulated seconds a weight load takes after the buckets arrived (slept at time_scale)."""
    vocab_size: int = QWEN2_VOCAB_SIZE
    """Token ids emitted are below it (pass the served model's vocabulary size)."""
    log: Path | None = None
    """JSONL file that gets one line per finished generate request."""
    initial_version: str = "default"
    """Weight-version label before anyone sets one ("default", like vLLM)."""
    shutdown_grace_s: float = 5.0
    """On SIGTERM/SIGINT, how long answering handlers get after in-flight requests end."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.time_scale > 0:
            raise ValueError(
                f"--time-scale must be > 0 (wall s per simulated s), got {self.time_scale}"
            )
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.sync_time_s < 0:
            raise ValueError(f"--sync-time-s must be >= 0, got {self.sync_time_s}")
        if self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2, got {self.vocab_size}")
        if not self.initial_version:
            raise ValueError("--initial-version must not be empty")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

    @property
    def url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host


class _OneLineParser(argparse.ArgumentParser):
    """A user's mistake is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2: what the user must change."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description=DESCRIPTION)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=0, help="port to listen on; 0 picks a free one (default)")
    add("--ready-file", type=Path, help='written as JSON {"url", "pid"} once listening')
    add(
        "--time-scale",
        type=float,
        default=0.01,
        help="wall seconds per simulated second (default: %(default)s)",
    )
    add("--seed", type=int, default=0, help="episode-stream seed (default: %(default)s)")
    add(
        "--sync-time-s",
        type=float,
        default=10.0,
        help="simulated seconds a weight load takes after its buckets arrived "
        "(default: %(default)s)",
    )
    add(
        "--vocab-size",
        type=int,
        default=QWEN2_VOCAB_SIZE,
        help="emitted token ids are below it (default: %(default)s, Qwen2's)",
    )
    add("--log", type=Path, help="JSONL file: one line per finished generate request")
    add(
        "--initial-version",
        default="default",
        help="weight-version label until one is set (default: %(default)s, like vLLM)",
    )
    return parser


def parse_config(argv: Sequence[str] | None = None) -> EmulatorConfig:
    """The config from the command line; a mistake exits 2 with one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        return EmulatorConfig(
            host=args.host,
            port=args.port,
            ready_file=args.ready_file,
            time_scale=args.time_scale,
            seed=args.seed,
            sync_time_s=args.sync_time_s,
            vocab_size=args.vocab_size,
            log=args.log,
            initial_version=args.initial_version,
        )
    except ValueError as exc:
        fail(str(exc))
