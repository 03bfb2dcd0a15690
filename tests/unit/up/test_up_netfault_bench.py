"""`make bench-netfault` (bench/netfault_bench.py) without a run: its help, its plan, and its
refusal of a link or a fault kind it does not know. The bench itself needs root and minutes of
`relayrl up`; it is not run in the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[3] / "bench" / "netfault_bench.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120
    )


def test_help_names_the_last_line() -> None:
    result = bench("--help")
    assert result.returncode == 0, result.stderr
    assert "--links" in result.stdout and "--quick" in result.stdout


def test_the_plan_puts_every_kind_and_a_fault_past_the_bound_on_each_link() -> None:
    result = bench("--plan-only", "--rounds", "3", "--seed", "1")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    links = {row[2] for row in rows}
    assert "gateway-redis" in links and "up-engine-0" in links
    for link in links:
        kinds = {row[1] for row in rows if row[2] == link and row[5] == "short"}
        assert kinds == {"partition", "refuse", "half_open", "half_open_restart", "slow"}, link
        (long,) = [float(row[3]) for row in rows if row[2] == link and row[5] == "long"]
        assert long > 30.0, link
    assert sum(row[5] == "random" for row in rows) == 3


def test_an_unknown_link_or_kind_is_refused_in_one_line() -> None:
    for args, word in ((["--links", "gateway-redis,trainer-moon"], "trainer-moon"),
                       (["--kinds", "partition,flood"], "flood")):  # fmt: skip
        result = bench("--plan-only", *args)
        assert result.returncode == 2
        assert result.stdout == ""
        error = result.stderr.strip().splitlines()[-1]
        assert word in error and "one of" in error, result.stderr
