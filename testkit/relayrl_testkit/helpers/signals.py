"""Signal handling shared by the benches, which start child processes and stop them in
`finally` blocks."""

from __future__ import annotations

import signal


def raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops the child processes."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
