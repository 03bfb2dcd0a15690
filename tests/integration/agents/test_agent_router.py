"""relayrl_testkit.agent_router, the served agent through which the suite's framework run serves
four programs: tasks go to the programs in turn, results pass through, every hand-over is
logged, and a program that dies takes the router down with its exit code (so the gateway fails
the tasks it held). Real processes on pipes, as the gateway runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# A served program: answers each task line with its result line, naming itself in the error
# field when the task asks it to fail, and exits 3 on a task whose messages say "die".
PROGRAM = """
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    task = json.loads(line)
    if task["messages"] == "die":
        sys.exit(3)
    print(json.dumps({"session_id": task["session_id"], "error": None, "by": name}), flush=True)
"""


def start_router(tmp_path: Path, names: list[str]) -> tuple[subprocess.Popen[str], Path]:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    log = tmp_path / "handed-out.jsonl"
    routes = [f"{name}={sys.executable} {program} {name}" for name in names]
    router = subprocess.Popen(
        [sys.executable, "-m", "relayrl_testkit.agent_router", "--log", str(log), *routes],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return router, log


def test_tasks_go_to_the_programs_in_turn_and_results_pass_through(tmp_path: Path) -> None:
    router, log = start_router(tmp_path, ["a", "b", "c"])
    tasks = "".join(
        json.dumps({"session_id": f"s{i}", "messages": [{"role": "user", "content": "same"}]})
        + "\n"
        for i in range(6)
    )
    out, err = router.communicate(tasks, timeout=60)
    assert router.returncode == 0, err
    results = {r["session_id"]: r["by"] for r in map(json.loads, out.splitlines())}
    owners = {e["session_id"]: e["agent"] for e in map(json.loads, log.read_text().splitlines())}
    assert owners == {f"s{i}": "abc"[i % 3] for i in range(6)}  # in turn, same prompt or not
    assert results == owners


def test_a_program_that_dies_ends_the_router_with_its_exit_code(tmp_path: Path) -> None:
    router, _ = start_router(tmp_path, ["a"])
    assert router.stdin is not None and router.stderr is not None
    router.stdin.write(json.dumps({"session_id": "s", "messages": "die"}) + "\n")
    router.stdin.flush()  # and kept open: the gateway has more tasks to give
    try:
        assert router.wait(60) == 3
    finally:
        router.kill()
    assert "agent_router: a exited 3" in router.stderr.read()


def test_a_route_without_a_command_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "relayrl_testkit.agent_router", "--log", str(tmp_path / "l"), "a="],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "'a=' is not NAME=COMMAND" in result.stderr
