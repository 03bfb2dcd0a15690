"""The `sandbox` manager against real child processes: right and wrong answers, both test
formats, every way a candidate can misbehave (loops, memory, fork, network, files, forged
results, early exit) scored as POLICY_FAIL, the sandbox's own failures as INFRA_ERROR, and the
child always killed and reaped (time limit, cancellation, close). The OS layers are also
checked alone, with the audit guard off, wherever this machine provides them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psutil
import pytest

from relayrl.reward.items import InfraError, InvalidItem, RewardItem, Status, Verdict
from relayrl.reward.managers.base import ManagerContext
from relayrl.reward.managers.sandbox import (
    SandboxConfig,
    SandboxManager,
    extract_code,
    parse_tests,
)

MIB = 1024 * 1024
TIME_LIMIT_S = 1.0
# Startup, reaping and a loaded 2-core machine, on top of a limit.
KILLED_WITHIN_S = 30.0

DOUBLE = "def double(x):\n    return 2 * x\n"
DOUBLE_TESTS = "assert double(1) == 2\nassert double(0) == 0\nassert double(-3) == -6\n"


def build(**overrides: object) -> SandboxManager:
    """A manager with short limits; build it inside the event loop that uses it."""
    settings: dict[str, object] = {
        "type": "sandbox",
        "time_limit_s": TIME_LIMIT_S,
        "memory_limit_bytes": 256 * MIB,
    }
    settings.update(overrides)
    return SandboxConfig.model_validate(settings).build("sandbox", ManagerContext())


def item(response: str, tests: str | None = None, *, ground_truth: str = "") -> RewardItem:
    extra = {"tests": tests} if tests is not None else {}
    return RewardItem(item_id="i1", response=response, ground_truth=ground_truth, extra=extra)


def run(body: Callable[[SandboxManager], Awaitable[object]], **overrides: object) -> object:
    """asyncio.run(body(manager)) with a fresh manager that is closed afterwards."""

    async def main() -> object:
        manager = build(**overrides)
        try:
            return await body(manager)
        finally:
            await manager.close()

    return asyncio.run(main())


def score(response: str, tests: str, **overrides: object) -> Verdict:
    verdict = run(lambda manager: manager.score(item(response, tests)), **overrides)
    assert isinstance(verdict, Verdict)
    return verdict


def layers(**overrides: object) -> tuple[str, ...]:
    found = run(lambda manager: manager.isolation_layers(), **overrides)
    assert isinstance(found, tuple)
    return found


# Processes this test process already had when a test began (the session's shared vLLM engine
# and its workers): they are not sandboxes, and neither is anything they start.
_before_test: set[int] = set()


@pytest.fixture(autouse=True)
def _only_new_children() -> None:
    _before_test.clear()
    _before_test.update(child.pid for child in psutil.Process().children())


def children() -> set[int]:
    """Pids of the processes this test started (sandboxes) and everything under them."""
    found: set[int] = set()
    for child in psutil.Process().children():
        if child.pid in _before_test:
            continue
        found.add(child.pid)
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended meanwhile
            found.update(grandchild.pid for grandchild in child.children(recursive=True))
    return found


def gone(pid: int) -> bool:
    """Neither running nor a zombie (a zombie would mean the child was never reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_DEAD
    except psutil.NoSuchProcess:
        return True


async def watched(awaitable: Awaitable[Verdict]) -> tuple[Verdict, set[int]]:
    """Await a score while recording the pids of every child process seen meanwhile."""
    task = asyncio.ensure_future(awaitable)
    seen: set[int] = set()
    while not task.done():
        seen |= children()
        await asyncio.sleep(0.02)
    return await task, seen


async def first_child(timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := children():
            return min(found)
        await asyncio.sleep(0.02)
    raise AssertionError("no sandbox child appeared")


@pytest.fixture
def loopback_listener() -> Iterator[socket.socket]:
    """A listening TCP socket on loopback that no sandboxed code may reach."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody got through


# -- parsing (no child) ------------------------------------------------------------------------


def test_extract_code_takes_the_last_python_block() -> None:
    response = (
        "First try:\n```python\nx = 1\n```\nBetter:\n```py\ndef f():\n    return 2\n```\nDone."
    )
    assert extract_code(response) == "def f():\n    return 2\n"
    assert extract_code("no fences, just code = 1") == "no fences, just code = 1"
    assert extract_code("```python\ndef g():\n    pass") == "def g():\n    pass"  # unterminated


def test_parse_tests_splits_each_format_into_tests() -> None:
    asserts = parse_tests("import math\nx = math.sqrt(4)\nassert x == 2\nassert True\n")
    assert [t.label for t in asserts] == ["assert x == 2", "assert True"]
    assert "math.sqrt(4)" in asserts[0].source
    humaneval = parse_tests("def check(candidate):\n    assert candidate(1) == 2\n\ncheck(f)\n")
    assert [t.label for t in humaneval] == ["check(f)"]
    pytest_style = parse_tests("import os\ndef test_a():\n    pass\ndef test_b(x=1):\n    pass\n")
    assert [t.label for t in pytest_style] == ["test_a()", "test_b()"]
    assert json.dumps([t.label for t in parse_tests('["assert f(1) == 2", "f(0)"]')]) == (
        '["assert f(1) == 2", "f(0)"]'
    )


@pytest.mark.parametrize(
    ("tests", "reason"),
    [
        ("", "no tests"),
        ("def helper():\n    assert False\n", "hold no test"),
        ("assert f(1 ==", "not valid Python"),
        ("[]", "one or more strings"),
        ('["assert f(", "assert True"]', "test 1 is not valid Python"),
    ],
)
def test_items_without_usable_tests_are_invalid(tests: str, reason: str) -> None:
    manager = build()
    with pytest.raises(InvalidItem, match=reason) as raised:
        manager.validate(item(DOUBLE, tests))
    assert raised.value.status is Status.INVALID_INPUT
    with pytest.raises(InvalidItem, match=reason):
        asyncio.run(manager.score(item(DOUBLE, tests)))


# -- answers -----------------------------------------------------------------------------------


def test_a_correct_solution_scores_one() -> None:
    response = f"Here is my solution.\n```python\n{DOUBLE}```\nIt doubles x."
    verdict = score(response, DOUBLE_TESTS)
    assert (verdict.status, verdict.score) == (Status.OK, 1.0)
    assert verdict.message == "3/3 tests passed"


def test_the_standard_library_imports_inside_the_sandbox() -> None:
    # Modules the harness never loads, C extensions included, imported after the uid drop.
    response = (
        "import decimal, fractions, heapq, statistics, zlib, asyncio\n"
        "def double(x):\n"
        "    return int(decimal.Decimal(x) * 2) + int(fractions.Fraction(0))\n"
    )
    assert score(response, DOUBLE_TESTS).status is Status.OK


def test_a_wrong_answer_fails_naming_the_first_failing_test() -> None:
    verdict = score("def double(x):\n    return x * x\n", DOUBLE_TESTS)
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert verdict.message == (
        "1/3 tests passed; test 1 failed: assert double(1) == 2: AssertionError"
    )
    assert verdict.components["pass_rate"] == pytest.approx(1 / 3)


def test_fraction_mode_scores_the_share_of_tests_passed() -> None:
    verdict = score("def double(x):\n    return abs(2 * x)\n", DOUBLE_TESTS, score_mode="fraction")
    assert verdict.status is Status.POLICY_FAIL
    assert verdict.score == pytest.approx(2 / 3)
    assert "test 3 failed: assert double(-3) == -6" in verdict.message


def test_json_test_lists_and_ground_truth_are_both_test_sources() -> None:
    listed = json.dumps(["assert double(2) == 4", "from solution import double as d\nd(1)"])
    assert score(DOUBLE, listed).status is Status.OK

    async def from_ground_truth(manager: SandboxManager) -> Verdict:
        return await manager.score(item(DOUBLE, ground_truth=DOUBLE_TESTS))

    verdict = run(from_ground_truth)
    assert isinstance(verdict, Verdict) and verdict.status is Status.OK


def test_humaneval_and_pytest_style_tests_run() -> None:
    check = "def check(candidate):\n    assert candidate(4) == 8\n\ncheck(double)\n"
    assert score(DOUBLE, check).status is Status.OK
    pytest_style = "def test_zero():\n    assert double(0) == 0\ndef test_one():\n    assert 0\n"
    verdict = score(DOUBLE, pytest_style, score_mode="fraction")
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.5)
    assert "test 2 failed: test_one()" in verdict.message


def test_a_syntax_error_is_the_policys_failure() -> None:
    verdict = score("def double(x:\n    return 2 * x\n", DOUBLE_TESTS)
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert verdict.message.startswith("syntax error in the candidate: ")


def test_an_exception_while_loading_fails_every_test() -> None:
    verdict = score("import nonexistent_module_xyz\n" + DOUBLE, DOUBLE_TESTS)
    assert verdict.status is Status.POLICY_FAIL
    assert "ModuleNotFoundError" in verdict.message and "0/3 tests passed" in verdict.message


# -- limits ------------------------------------------------------------------------------------


def test_an_infinite_loop_hits_the_time_limit_and_leaves_no_process() -> None:
    async def body(manager: SandboxManager) -> tuple[Verdict, set[int], float]:
        start = time.monotonic()
        verdict, pids = await watched(
            manager.score(item("def spin():\n    while True: pass\n", "assert spin()"))
        )
        return verdict, pids, time.monotonic() - start

    verdict, pids, elapsed = run(body)  # type: ignore[misc]
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert verdict.message.startswith(f"time limit {TIME_LIMIT_S} s exceeded in test 1")
    # Not killed early; and killed at all (the loop never ends by itself): the upper bound is
    # generous because this machine is shared, not a performance claim.
    assert TIME_LIMIT_S <= elapsed < TIME_LIMIT_S + KILLED_WITHIN_S
    assert pids and all(gone(pid) for pid in pids)


def test_the_cpu_limit_backs_up_the_wall_clock_limit() -> None:
    verdict = score("while True:\n    pass\n", "assert True", time_limit_s=30.0, cpu_limit_s=1)
    assert verdict.status is Status.POLICY_FAIL
    assert verdict.message.startswith("CPU time limit 1 s exceeded while loading the candidate")


@pytest.mark.parametrize(
    ("response", "tests"),
    [
        ("x = bytearray(10**10)\n", "assert True"),
        (
            "def hog():\n    kept = []\n    while True:\n        kept.append('x' * 100_000)\n",
            "hog()",
        ),
    ],
    ids=["one-allocation", "growing-list"],
)
def test_memory_bombs_fail_with_the_memory_limit(response: str, tests: str) -> None:
    verdict = score(response, tests)
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert "memory limit exceeded" in verdict.message


def test_writing_past_the_file_size_limit_fails() -> None:
    response = "def dump():\n    open('big.bin', 'wb').write(b'x' * (2 << 20))\n    return True\n"
    verdict = score(response, "assert dump()", max_file_bytes=1 * MIB)
    assert verdict.status is Status.POLICY_FAIL
    assert "File too large" in verdict.message


def test_output_floods_are_truncated_not_fatal() -> None:
    response = DOUBLE + "print('x' * 10_000_000)\nimport sys\nsys.stderr.write('y' * 10_000_000)\n"
    assert score(response, DOUBLE_TESTS, max_output_bytes=1024).status is Status.OK


# -- escapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attempt",
    [
        "import os\nos.fork()",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\ntry:\n    os.fork()\nexcept BaseException:\n    pass",  # caught: still fails
    ],
    ids=["os.fork", "subprocess", "os.system", "caught"],
)
def test_fork_attempts_are_blocked(attempt: str) -> None:
    verdict = score(DOUBLE + attempt + "\n", DOUBLE_TESTS, score_mode="fraction")
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert verdict.message.startswith("blocked: fork")


def test_an_escape_attempt_forfeits_the_tests_passed_before_it() -> None:
    sneaky = DOUBLE + "def sneaky():\n    import os\n    os.fork()\n    return True\n"
    verdict = score(sneaky, DOUBLE_TESTS + "assert sneaky()\n", score_mode="fraction")
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert verdict.message == "blocked: fork (os.fork)"
    assert verdict.components["pass_rate"] == pytest.approx(3 / 4)


def test_network_attempts_are_blocked(loopback_listener: socket.socket) -> None:
    port = loopback_listener.getsockname()[1]
    response = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
    verdict = score(response, "assert True")
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert verdict.message.startswith("blocked: network")


def test_writes_outside_the_work_dir_are_blocked() -> None:
    target = Path(tempfile.gettempdir()) / f"relayrl-sandbox-escape-{os.getpid()}"
    verdict = score(f"open({str(target)!r}, 'w').write('x')\n", "assert True")
    assert verdict.status is Status.POLICY_FAIL
    assert verdict.message.startswith(f"blocked: file (write to {target})")
    assert not target.exists()


def test_fork_is_refused_by_the_os_without_the_audit_guard() -> None:
    if "nproc" not in layers(audit_guard=False):
        pytest.skip("RLIMIT_NPROC is not enforced for this sandbox here (running as root?)")
    response = "import os\ndef spawn():\n    os.fork()\n    return True\n"
    verdict = score(response, "assert spawn()", audit_guard=False)
    assert verdict.status is Status.POLICY_FAIL
    assert "BlockingIOError" in verdict.message


def test_the_network_is_unreachable_without_the_audit_guard(
    loopback_listener: socket.socket,
) -> None:
    if not {"netns", "userns+netns"} & set(layers(audit_guard=False)):
        pytest.skip("no private network namespace on this machine")
    port = loopback_listener.getsockname()[1]
    response = (
        "import socket\ndef reach():\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return True\n"
    )
    verdict = score(response, "assert reach()", audit_guard=False)
    assert verdict.status is Status.POLICY_FAIL
    assert "Network is unreachable" in verdict.message


def test_printed_or_injected_results_cannot_forge_a_pass() -> None:
    fake = json.dumps({"event": "test", "index": 0, "passed": True})
    forgery = (
        "import os, sys\n"
        f"for prefix in ('', '0' * 32 + ' '):\n"
        f'    for line in (prefix + {fake!r}, prefix + \'{{"event": "done"}}\'):\n'
        "        print(line)\n"
        "        print(line, file=sys.stderr)\n"
        "        for fd in range(3, 64):\n"
        "            try:\n"
        "                os.write(fd, (line + '\\n').encode())\n"
        "            except OSError:\n"
        "                pass\n"
        "def double(x):\n    return x\n"
    )
    verdict = score(forgery, DOUBLE_TESTS)
    assert (verdict.status, verdict.score) == (Status.POLICY_FAIL, 0.0)
    assert "test 1 failed" in verdict.message


def test_flooding_the_result_channel_fails() -> None:
    flood = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'x' * (5 << 20))\n"
        "    except OSError:\n"
        "        pass\n"
    )
    verdict = score(DOUBLE + flood, DOUBLE_TESTS)
    assert verdict.status is Status.POLICY_FAIL
    assert "wrote over" in verdict.message and "result channel" in verdict.message


def test_exiting_before_the_tests_fails() -> None:
    verdict = score(DOUBLE + "import os\nos._exit(0)\n", DOUBLE_TESTS)
    assert verdict.status is Status.POLICY_FAIL
    assert verdict.message.startswith(
        "the candidate ended the interpreter (exit code 0) while loading the candidate"
    )


# -- the sandbox itself ------------------------------------------------------------------------


def test_isolation_layers_report_what_is_active() -> None:
    found = layers()
    assert {"rlimits", "no_new_privs", "audit_guard"} <= set(found)
    if os.geteuid() == 0:
        assert {"netns", "nproc"} <= set(found)
        assert any(layer.startswith("uid:") for layer in found)


def test_the_work_dir_is_removed_after_each_item() -> None:
    work_root = tempfile.mkdtemp(prefix="relayrl-sandbox-test-")
    os.chmod(work_root, 0o711)  # reachable by the sandbox uids
    try:
        response = DOUBLE + "open('scratch.txt', 'w').write('x')\nimport os\nos.mkdir('sub')\n"
        assert score(response, DOUBLE_TESTS, work_root=work_root).status is Status.OK
        assert os.listdir(work_root) == []
    finally:
        shutil.rmtree(work_root)


def test_a_missing_interpreter_is_an_infra_error() -> None:
    with pytest.raises(InfraError, match="cannot start the sandbox interpreter"):
        score(DOUBLE, DOUBLE_TESTS, python="/nonexistent/bin/python3")


def test_an_interpreter_that_exits_at_once_is_an_infra_error() -> None:
    with pytest.raises(InfraError, match=r"exited before running the candidate \(exit code 1\)"):
        score(DOUBLE, DOUBLE_TESTS, python=shutil.which("false") or "/bin/false")


def test_a_sandbox_that_never_starts_is_an_infra_error(tmp_path: Path) -> None:
    hanging = tmp_path / "hanging-python"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(hanging.stat().st_mode | stat.S_IXUSR)

    async def body(manager: SandboxManager) -> set[int]:
        with pytest.raises(InfraError, match=r"did not start within 0\.5 s"):
            await watched(manager.score(item(DOUBLE, DOUBLE_TESTS)))
        return children()

    assert run(body, python=str(hanging), startup_timeout_s=0.5) == set()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands work dirs to other uids")
def test_a_work_root_the_sandbox_uid_cannot_reach_is_an_infra_error(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)
    with pytest.raises(InfraError, match=r"could not be set up: .*not writable by uid"):
        score(DOUBLE, DOUBLE_TESTS, work_root=str(tmp_path))


# -- concurrency, cancellation, close ----------------------------------------------------------


def test_concurrent_sandboxes_all_finish_within_max_concurrent() -> None:
    answers = [DOUBLE, "def double(x):\n    return x\n"] * 3

    async def body(manager: SandboxManager) -> tuple[list[Verdict], int]:
        peak = 0

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(children()))
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        try:
            verdicts = await asyncio.gather(
                *(manager.score(item(answer, DOUBLE_TESTS)) for answer in answers)
            )
        finally:
            sampler.cancel()
        return list(verdicts), peak

    verdicts, peak = run(body, max_concurrent=2)  # type: ignore[misc]
    assert [v.status for v in verdicts] == [Status.OK, Status.POLICY_FAIL] * 3
    assert 1 <= peak <= 2
    assert children() == set()


def test_cancellation_kills_the_child() -> None:
    async def body(manager: SandboxManager) -> int:
        task = asyncio.create_task(manager.score(item("while True:\n    pass\n", "assert True")))
        pid = await first_child()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    pid = run(body, time_limit_s=30.0)
    assert isinstance(pid, int) and gone(pid)
    assert children() == set()


def test_close_kills_running_sandboxes_and_refuses_new_items() -> None:
    async def body(manager: SandboxManager) -> int:
        task = asyncio.create_task(manager.score(item("while True:\n    pass\n", "assert True")))
        pid = await first_child()
        await manager.close()
        with pytest.raises(InfraError, match="closed while the item ran"):
            await task
        with pytest.raises(InfraError, match="manager is closed"):
            await manager.score(item(DOUBLE, DOUBLE_TESTS))
        return pid

    pid = run(body, time_limit_s=30.0)
    assert isinstance(pid, int) and gone(pid)


_WITHOUT_NETNS = """
import asyncio, json, sys
from relayrl.reward.items import InfraError, RewardItem
from relayrl.reward.managers.base import ManagerContext
from relayrl.reward.managers.sandbox import SandboxConfig

async def main():
    config = SandboxConfig.model_validate(json.loads(sys.argv[1]))
    manager = config.build("sandbox", ManagerContext())
    item = RewardItem(item_id="i1", response=sys.argv[2], extra={"tests": sys.argv[3]})
    try:
        verdict = await manager.score(item)
        layers = list(await manager.isolation_layers())
        print(json.dumps({"score": verdict.score, "layers": layers}))
    except InfraError as exc:
        print(json.dumps({"infra": str(exc)}))
    finally:
        await manager.close()

asyncio.run(main())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
@pytest.mark.parametrize("required", [True, False])
def test_without_a_network_namespace_candidate_code_does_not_run_unless_allowed(
    required: bool,
) -> None:
    """A service whose capabilities do not include CAP_SYS_ADMIN (as a pod with capabilities
    dropped) cannot make a private network namespace: every item is INFRA_ERROR saying why,
    and the candidate's code never runs, unless require_network_isolation is false."""
    settings = {
        "type": "sandbox",
        "time_limit_s": 5.0,
        "memory_limit_bytes": 256 * MIB,
        "require_network_isolation": required,
    }
    done = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c",
         _WITHOUT_NETNS, json.dumps(settings), DOUBLE, DOUBLE_TESTS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if required:
        assert "no private network namespace" in result["infra"], result
        assert "candidate code does not run without one" in result["infra"]
    else:
        assert result["score"] == 1.0 and "netns" not in result["layers"], result
