"""The `sandbox` reward manager: runs the policy's Python answer against the item's tests in a
locked-down child process and rewards the tests it passes.

Item format
-----------
- `response`: the answer. The code is its last ```python (or ```py) fenced block, or the whole
  response when it has none.
- `extra["tests"]`, else `ground_truth`: the tests, in one of two forms:
  * Python source. Each top-level `assert` is one test, together with the statements since the
    previous one (`x = f(2)` then `assert x == 4` is one test). Statements after the last
    assert are one more test unless they only define things (HumanEval's `check(candidate)`
    call is such a test). A source with neither (pytest style) has one test per top-level
    `def test*()` that takes no arguments.
  * A JSON list of strings, each one test: `["assert f(1) == 2", "assert f(2) == 4"]`.
  Tests run in order, in the candidate's module namespace (they may also `from solution
  import f`). An item without tests, or with tests that do not parse, is INVALID_INPUT.

Who is at fault
---------------
Everything the candidate's code does is the policy's answer: failing tests, exceptions, syntax
errors, running past the time or CPU limit (an infinite loop is a wrong answer, not a
TIMEOUT, which would hide it from the reward), running out of memory, and trying to fork, reach
the network or write outside its work dir. All of these are POLICY_FAIL, with a message that
says which. INFRA_ERROR is kept for the sandbox failing itself: the interpreter cannot start,
the work dir cannot be made, setting up isolation fails, the harness breaks. The line between
the two is the harness's `started` report, sent after every layer is in place and before any
candidate code runs (see `sandbox_harness`); the time limit also only starts there, so a slow
start on a loaded machine is never charged to the policy.

Isolation layers (the harness reports which were active; `isolation_layers()` asks)
-----------------------------------------------------------------------------------
- `python -I -B -X utf8` (and `-S` unless `site_packages`), a cleared environment, a fresh
  work dir as cwd, HOME and TMPDIR (deleted afterwards), stdin closed after the job is read.
- A new session: the wall-clock limit kills the whole process group with SIGKILL, as do
  cancellation and `close()`; the child is always reaped.
- rlimits: CPU, address space, file size, open files, no core dumps.
- `netns` (private network namespace) as root, or `userns+netns` as another user where user
  namespaces are allowed. Where neither works the item fails as INFRA_ERROR, saying why,
  and no candidate code runs; only with `require_network_isolation: false` does it run with
  the audit guard alone keeping it off the network (a warning is logged once).
  A pod that may not isolate (non-root, capabilities dropped) runs the sandbox as a process of
  its own instead: `relayrl-sandbox` beside it, reached with a `sandbox_remote` manager.
- `uid:N`: as root, each concurrent sandbox slot runs as its own uid/gid
  (`sandbox_uid_base + slot`), which makes RLIMIT_NPROC (`nproc`) block fork and threads, keeps
  concurrent candidates out of each other's work dirs and processes, and stops writes to
  anything root owns. (An interpreter under a private directory such as /root/.pyenv stays
  importable: the harness opens its library directories before the drop.)
- `no_new_privs`, and death of the child with the service (PR_SET_PDEATHSIG).
- `audit_guard`: an audit hook in the child that blocks fork/exec/subprocess, sockets
  (connect, bind, DNS), ctypes, signals, rlimit changes and (best effort) writes outside the
  work dir. Any blocked attempt fails the item with score 0, even if the code caught it.
Not covered: reading files the sandbox uid may read, CPU/memory use of the kernel on the
child's behalf, and tests fooled from inside (an object whose __eq__ always answers True).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from relayrl.reward.items import InfraError, InvalidItem, RewardItem, Status, Verdict
from relayrl.reward.managers.base import ManagerConfigBase, ManagerContext, RewardManager

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
HARNESS = Path(__file__).with_name("sandbox_harness.py")
TESTS_KEY = "tests"
# The harness's own reports are small (messages are capped at 2000 characters); more than this
# on the result channel is the candidate writing to it, and is dropped.
RESULT_LIMIT_BYTES = 4 * MIB
# How long the pipes may stay open after the child has exited (they close with it).
READER_GRACE_S = 5.0
LABEL_CHARS = 120
STDERR_TAIL_CHARS = 500
MEMORY_HINTS = (b"MemoryError", b"Cannot allocate memory", b"out of memory")
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"

_FENCE = re.compile(
    r"^[ \t]*```[ \t]*(?:python3?|py)[ \t]*$\n?(.*?)(?:^[ \t]*```|\Z)",
    re.DOTALL | re.IGNORECASE | re.MULTILINE,
)
_DEFINITIONS = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Import,
    ast.ImportFrom,
)


class SandboxConfig(ManagerConfigBase):
    """A `sandbox` manager: executes Python answers against tests, isolated (see the module
    docstring for the item format and the isolation layers)."""

    type: Literal["sandbox"] = Field(description="Manager type.")
    python: str = Field(
        sys.executable,
        min_length=1,
        max_length=4096,
        description="Interpreter that runs the candidate (default: the service's own). Its "
        "standard library must be readable; it need not have relayrl installed.",
    )
    site_packages: bool = Field(
        False,
        description="Let candidates import the interpreter's site-packages; false runs it "
        "with -S (standard library only: faster to start, less to attack).",
    )
    time_limit_s: float = Field(
        5.0,
        gt=0.0,
        le=600.0,
        description="Wall-clock limit of one item's candidate code and tests, counted from "
        "the moment the sandbox is ready; past it the child is killed and the item fails.",
    )
    cpu_limit_s: int | None = Field(
        None,
        ge=1,
        le=3600,
        description="RLIMIT_CPU of the child in seconds (whole seconds: the kernel's unit); "
        "null: ceil(time_limit_s) + 1, a backstop behind the wall-clock limit.",
    )
    startup_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="How long the sandbox may take to start and isolate itself; running "
        "over is the sandbox's failure (INFRA_ERROR), not the candidate's.",
    )
    memory_limit_bytes: int = Field(
        512 * MIB,
        ge=32 * MIB,
        le=1 << 40,
        description="RLIMIT_AS (address space) of the child, the interpreter included.",
    )
    max_file_bytes: int = Field(
        16 * MIB,
        ge=0,
        le=1 << 40,
        description="RLIMIT_FSIZE: the largest file the candidate may write.",
    )
    max_open_files: int = Field(
        64,
        ge=16,
        le=65536,
        description="RLIMIT_NOFILE of the child (the interpreter needs a handful).",
    )
    max_processes: int = Field(
        1,
        ge=1,
        le=4096,
        description="RLIMIT_NPROC: processes and threads of the sandbox uid together; 1 "
        "allows no fork and no thread. Exact when the sandbox has a uid or user namespace of "
        "its own; root ignores it.",
    )
    max_output_bytes: int = Field(
        64 * 1024,
        ge=0,
        le=64 * MIB,
        description="Bytes of the candidate's stdout and of its stderr kept (the rest is read "
        "and dropped); stderr's tail appears in messages about crashes.",
    )
    isolate_network: bool = Field(
        True,
        description="Give the child a private network namespace and block socket use in the "
        "audit guard; false leaves the network reachable (trusted code only).",
    )
    require_network_isolation: bool = Field(
        True,
        description="With isolate_network: where the kernel refuses a private network "
        "namespace (a non-root pod whose runtime forbids user namespaces), every item fails "
        "as INFRA_ERROR saying why instead of running; false runs the code with the audit "
        "guard alone between it and the network (trusted code only; a warning is logged).",
    )
    audit_guard: bool = Field(
        True,
        description="Install the in-process audit hook (fork, network, ctypes, signals, "
        "rlimits, writes outside the work dir). Turn off only to test the OS layers alone.",
    )
    sandbox_uid_base: int | None = Field(
        60000,
        ge=1,
        le=2**31 - 2048,
        description="When the service runs as root, sandbox slot i runs as uid and gid "
        "sandbox_uid_base + i (max_concurrent ids used by nothing else, nor by another "
        "sandbox manager); null keeps root in the sandbox, which leaves fork to the audit "
        "guard alone.",
    )
    max_concurrent: int = Field(
        2,
        ge=1,
        le=1024,
        description="Sandboxes running at once (each is one process on one core).",
    )
    score_mode: Literal["all_or_nothing", "fraction"] = Field(
        "all_or_nothing",
        description="all_or_nothing: 1 when every test passes, else 0; fraction: the share "
        "of tests passed (a blocked escape attempt still scores 0).",
    )
    work_root: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="Directory for the per-item work dirs; null: the system temp dir. The "
        "sandbox uids must be able to reach it.",
    )

    @property
    def effective_cpu_limit_s(self) -> int:
        if self.cpu_limit_s is not None:
            return self.cpu_limit_s
        return math.ceil(self.time_limit_s) + 1

    def build(self, name: str, context: ManagerContext) -> SandboxManager:
        return SandboxManager(name, self)


@dataclass(frozen=True, slots=True)
class CodeTest:
    """One test: Python source run in the candidate's namespace, and how messages name it."""

    source: str
    label: str


def extract_code(response: str) -> str:
    """The last ```python / ```py fenced block of `response` (to the end of the text when
    its closing fence is missing), or all of `response` when it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _label(source: str) -> str:
    lines = source.strip().splitlines() or [""]
    label = lines[0] + (" ..." if len(lines) > 1 else "")
    return label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 3] + "..."


def _takes_no_arguments(function: ast.FunctionDef) -> bool:
    args = function.args
    positional = len(args.posonlyargs) + len(args.args)
    return positional == len(args.defaults) and all(d is not None for d in args.kw_defaults)


def _split_source(text: str) -> list[CodeTest]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"the tests are not valid Python: {exc}") from None

    def unit(statements: list[ast.stmt], labelled: ast.stmt) -> CodeTest:
        source = ast.unparse(ast.Module(body=statements, type_ignores=[]))
        shown = ast.get_source_segment(text, labelled) or ast.unparse(labelled)
        return CodeTest(source, _label(shown))

    tests: list[CodeTest] = []
    pending: list[ast.stmt] = []
    for statement in tree.body:
        pending.append(statement)
        if isinstance(statement, ast.Assert):
            tests.append(unit(pending, statement))
            pending = []
    actions = [s for s in pending if not isinstance(s, _DEFINITIONS)]
    if actions:
        tests.append(unit(pending, actions[-1]))
    elif not tests:
        names = [
            s.name
            for s in tree.body
            if isinstance(s, ast.FunctionDef)
            and s.name.startswith("test")
            and _takes_no_arguments(s)
        ]
        for index, name in enumerate(names):
            setup = ast.unparse(ast.Module(body=pending, type_ignores=[])) if index == 0 else ""
            tests.append(CodeTest(f"{setup}\n{name}()".lstrip("\n"), f"{name}()"))
    if not tests:
        raise ValueError(
            "the tests hold no test: no top-level assert, no statement after the "
            "definitions, no test function"
        )
    return tests


def parse_tests(text: str) -> list[CodeTest]:
    """Split a tests text (module docstring: Python source or a JSON list of strings) into
    tests. Raises ValueError saying what is wrong with it."""
    stripped = text.strip()
    if not stripped:
        raise ValueError("the tests are empty")
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            value = None  # not JSON: Python source that starts with a list
        if isinstance(value, list):
            if not value or not all(isinstance(entry, str) for entry in value):
                raise ValueError("a JSON test list must hold one or more strings")
            for index, source in enumerate(value):
                try:
                    ast.parse(source)
                except (SyntaxError, ValueError) as exc:
                    raise ValueError(f"test {index + 1} is not valid Python: {exc}") from None
            return [CodeTest(source, _label(source)) for source in value]
    return _split_source(text)


def item_tests(item: RewardItem) -> tuple[str, list[CodeTest]]:
    """An item's tests text (`extra["tests"]`, else `ground_truth`) and its tests; InvalidItem
    saying what is wrong with them."""
    text = item.extra.get(TESTS_KEY) or item.ground_truth
    if not text.strip():
        raise InvalidItem(
            f"item {item.item_id!r}: no tests; put them in extra[{TESTS_KEY!r}] or ground_truth"
        )
    try:
        return text, parse_tests(text)
    except ValueError as exc:
        raise InvalidItem(f"item {item.item_id!r}: {exc}") from None


@dataclass(slots=True)
class _Outcome:
    """How one step (a test, or loading the candidate) failed or passed, as reported."""

    passed: bool
    exc_type: str = ""
    message: str = ""
    memory: bool = False

    def describe(self) -> str:
        if self.memory:
            return "memory limit exceeded (MemoryError)"
        return f"{self.exc_type}: {self.message}" if self.message else self.exc_type


@dataclass(slots=True)
class _Run:
    """Everything one child run produced."""

    started: bool = False
    loaded: bool = False
    done: bool = False
    layers: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    results: dict[int, _Outcome] = field(default_factory=dict)
    candidate_error: tuple[str, _Outcome] | None = None
    violation: str | None = None
    setup_error: str | None = None
    harness_error: str | None = None
    protocol_error: str | None = None
    startup_timed_out: bool = False
    timed_out: bool = False
    flooded: bool = False
    returncode: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""

    def on_report(self, record: dict[str, object], started: asyncio.Event) -> None:
        event = record["event"]
        if event == "started":
            self.started = True
            self.layers = _strings(record["layers"])
            self.warnings = _strings(record["warnings"])
            started.set()
        elif event == "loaded":
            self.loaded = True
        elif event == "test":
            index = record["index"]
            if not isinstance(index, int):
                raise TypeError(f"test index {index!r} is not an int")
            self.results[index] = _outcome(record)
        elif event == "candidate_error":
            self.candidate_error = (str(record["kind"]), _outcome(record))
        elif event == "violation":
            if self.violation is None:
                self.violation = f"{record['category']} ({record['detail']})"
        elif event == "infra_error":
            self.setup_error = str(record["message"])
        elif event == "harness_error":
            self.harness_error = str(record["message"])
        elif event == "done":
            self.done = True
        else:
            raise ValueError(f"unknown report {event!r}")


def _strings(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return tuple(str(entry) for entry in value)


def _outcome(record: dict[str, object]) -> _Outcome:
    return _Outcome(
        passed=bool(record.get("passed", False)),
        exc_type=str(record.get("exc_type", "")),
        message=str(record.get("message", "")),
        memory=bool(record.get("memory", False)),
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_text(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    return f"exit code {returncode}"


def _stderr_tail(stderr: bytes) -> str:
    text = stderr.decode("utf-8", "replace").strip()
    if not text:
        return ""
    return ": " + (text if len(text) <= STDERR_TAIL_CHARS else "..." + text[-STDERR_TAIL_CHARS:])


def _kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's process group (its pgid is its pid: it was started in a new
    session), unless asyncio has seen it exit. asyncio's child watcher reaps in a thread and
    reports a moment later, so the pid could in theory be reused in that window; the same
    window exists for asyncio's own Process.kill."""
    if process.returncode is None:
        # ProcessLookupError: it exited on its own; the child watcher reaps it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader | None, limit: int) -> bytes:
    """Read a stream to its end, keeping the first `limit` bytes: the child must never block
    on a full pipe, and a flood must not grow the service's memory."""
    if stream is None:
        return b""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        room = limit - len(kept)
        if room > 0:
            kept += chunk[:room]
    return bytes(kept)


async def _send_job(process: asyncio.subprocess.Process, job: bytes) -> None:
    stdin = process.stdin
    if stdin is None:
        return
    try:
        stdin.write(job)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the child died before reading it; its exit tells why
    finally:
        stdin.close()


def _remove_tree(path: str) -> None:
    """Delete a work dir whatever the candidate left in it. Running as the service's own uid,
    the candidate may have made directories unreadable, so give them back first (never
    through a symlink: that could chmod something outside)."""
    try:
        if os.geteuid() != 0:
            os.chmod(path, 0o700)
            for root, dirs, _ in os.walk(path):
                for name in dirs:
                    full = os.path.join(root, name)
                    if not os.path.islink(full):
                        os.chmod(full, 0o700)
        shutil.rmtree(path)
    except OSError as exc:
        logger.warning("could not remove the sandbox work dir %s: %s", path, exc)


class SandboxManager(RewardManager):
    """Scores an item by running its code and tests in a fresh sandbox (one child process per
    item, at most `max_concurrent` at once)."""

    type_name = "sandbox"

    def __init__(self, name: str, config: SandboxConfig) -> None:
        super().__init__(name, max_concurrent=config.max_concurrent)
        self.config = config
        self._as_root = os.geteuid() == 0
        self._free_slots = list(range(config.max_concurrent))
        self._slot_ready = asyncio.Semaphore(config.max_concurrent)
        self._running: set[asyncio.subprocess.Process] = set()
        self._warned: set[str] = set()
        self._closed = False

    def validate(self, item: RewardItem) -> None:
        self._tests_of(item)

    async def score(self, item: RewardItem) -> Verdict:
        return await self.judge(extract_code(item.response), self._tests_of(item))

    async def judge(self, code: str, tests: Sequence[CodeTest]) -> Verdict:
        """Run `code` and then `tests` in a fresh sandbox: the verdict, or InfraError."""
        run = await self._run(code, tests)
        return self._verdict(run, tests)

    async def isolation_layers(self) -> tuple[str, ...]:
        """Start a sandbox with nothing to run and return the isolation layers it reported
        (for a startup log line or a health check). Raises InfraError if it cannot start."""
        run = await self._run("", [CodeTest("pass", "pass")])
        self._check_started(run)
        return run.layers

    async def close(self) -> None:
        """Kill every running sandbox (their items fail with INFRA_ERROR) and reap them."""
        self._closed = True
        running = list(self._running)
        for process in running:
            _kill(process)
        await asyncio.gather(*(process.wait() for process in running))

    def _tests_of(self, item: RewardItem) -> list[CodeTest]:
        return item_tests(item)[1]

    async def _run(self, code: str, tests: Sequence[CodeTest]) -> _Run:
        if self._closed:
            raise InfraError("the sandbox manager is closed")
        async with self._slot_ready:
            if self._closed:  # closed while this item waited for a slot
                raise InfraError("the sandbox manager is closed")
            slot = self._free_slots.pop()
            try:
                uid = None
                if self._as_root and self.config.sandbox_uid_base is not None:
                    uid = self.config.sandbox_uid_base + slot
                workdir = self._make_workdir(uid)
                try:
                    run = await self._run_child(workdir, uid, code, tests)
                finally:
                    # In a thread, shielded: a second cancellation must not leave it behind.
                    await asyncio.shield(asyncio.to_thread(_remove_tree, workdir))
            finally:
                self._free_slots.append(slot)
        if self._closed:
            raise InfraError("the sandbox manager was closed while the item ran")
        return run

    def _make_workdir(self, uid: int | None) -> str:
        try:
            path = tempfile.mkdtemp(prefix="relayrl-sandbox-", dir=self.config.work_root)
        except OSError as exc:
            raise InfraError(f"cannot create the sandbox work dir: {exc}") from exc
        if uid is not None:
            try:
                os.chown(path, uid, uid)
            except OSError as exc:
                _remove_tree(path)
                raise InfraError(f"cannot hand the work dir to uid {uid}: {exc}") from exc
        return path

    def _job(
        self, workdir: str, uid: int | None, code: str, tests: Sequence[CodeTest]
    ) -> dict[str, object]:
        config = self.config
        return {
            "nonce": secrets.token_hex(16),
            "code": code,
            "tests": [test.source for test in tests],
            "workdir": workdir,
            "uid": uid,
            "gid": uid,
            "parent_pid": os.getpid(),
            "isolate_network": config.isolate_network,
            "require_network_isolation": config.require_network_isolation,
            "audit_guard": config.audit_guard,
            "cpu_limit_s": config.effective_cpu_limit_s,
            "memory_limit_bytes": config.memory_limit_bytes,
            "max_file_bytes": config.max_file_bytes,
            "max_open_files": config.max_open_files,
            "max_processes": config.max_processes,
        }

    async def _run_child(
        self, workdir: str, uid: int | None, code: str, tests: Sequence[CodeTest]
    ) -> _Run:
        config = self.config
        job = self._job(workdir, uid, code, tests)
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        results = asyncio.StreamReader()
        try:
            pipe = os.fdopen(read_fd, "rb", buffering=0)
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(results), pipe
            )
        except BaseException:
            pipe.close()
            os.close(write_fd)
            raise
        try:
            argv = [config.python, "-I", "-B", "-X", "utf8"]
            if not config.site_packages:
                argv.append("-S")
            argv += [str(HARNESS), str(write_fd)]
            env = {
                "PATH": CHILD_PATH,
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
            }
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=(write_fd,),
                    cwd=workdir,
                    env=env,
                    start_new_session=True,
                )
            except (OSError, ValueError) as exc:
                raise InfraError(
                    f"cannot start the sandbox interpreter {config.python!r}: {exc}"
                ) from exc
            finally:
                os.close(write_fd)
            return await self._supervise(process, results, job)
        finally:
            transport.close()

    async def _supervise(
        self,
        process: asyncio.subprocess.Process,
        results: asyncio.StreamReader,
        job: dict[str, object],
    ) -> _Run:
        """Feed the job, read the reports and outputs, enforce the startup timeout and then
        the time limit, and always kill and reap the child (on cancellation too)."""
        run = _Run()
        started = asyncio.Event()
        self._running.add(process)
        io_tasks = [
            asyncio.create_task(_send_job(process, json.dumps(job).encode())),
            asyncio.create_task(self._read_reports(results, str(job["nonce"]), run, started)),
            asyncio.create_task(_drain(process.stdout, self.config.max_output_bytes)),
            asyncio.create_task(_drain(process.stderr, self.config.max_output_bytes)),
        ]
        exit_task = asyncio.create_task(process.wait())
        try:
            started_task = asyncio.create_task(started.wait())
            try:
                await asyncio.wait(
                    {started_task, exit_task},
                    timeout=self.config.startup_timeout_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                started_task.cancel()
            if not exit_task.done():
                if started.is_set():
                    await asyncio.wait({exit_task}, timeout=self.config.time_limit_s)
                    run.timed_out = not exit_task.done()
                else:
                    run.startup_timed_out = True
                _kill(process)
            run.returncode = await exit_task
            finished, unfinished = await asyncio.wait(io_tasks, timeout=READER_GRACE_S)
            if unfinished:
                run.protocol_error = "the child's pipes stayed open after it exited"
            run.stdout = io_tasks[2].result() if io_tasks[2] in finished else b""
            run.stderr = io_tasks[3].result() if io_tasks[3] in finished else b""
            if io_tasks[1] in finished:
                io_tasks[1].result()  # a bug in reading the reports surfaces here
            return run
        finally:
            _kill(process)
            try:
                await exit_task
            finally:
                for task in io_tasks:
                    task.cancel()
                self._running.discard(process)

    async def _read_reports(
        self, results: asyncio.StreamReader, nonce: str, run: _Run, started: asyncio.Event
    ) -> None:
        """Parse the harness's `<nonce> <json>` lines as they arrive. Lines without the nonce
        are the candidate writing to the channel and are ignored; a line with it that does not
        parse means the protocol broke."""
        prefix = nonce.encode("ascii") + b" "
        buffer = bytearray()
        received = 0
        while chunk := await results.read(1 << 16):
            received += len(chunk)
            if received > RESULT_LIMIT_BYTES:
                run.flooded = True  # only the candidate writes this much; drain, drop it
                continue
            buffer += chunk
            while (end := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                if not line.startswith(prefix):
                    continue
                try:
                    record = json.loads(line[len(prefix) :])
                    run.on_report(record, started)
                except (ValueError, KeyError, TypeError) as exc:
                    run.protocol_error = f"unreadable report {line[:200]!r}: {exc}"

    def _check_started(self, run: _Run) -> None:
        """Raise InfraError unless the sandbox got as far as running candidate code; log each
        isolation warning it reported once per manager."""
        if run.setup_error is not None:
            raise InfraError(f"the sandbox could not be set up: {run.setup_error}")
        if not run.started:
            if run.startup_timed_out:
                raise InfraError(
                    f"the sandbox did not start within {self.config.startup_timeout_s} s"
                )
            raise InfraError(
                "the sandbox exited before running the candidate "
                f"({_exit_text(run.returncode)}){_stderr_tail(run.stderr)}"
            )
        for warning in run.warnings:
            if warning not in self._warned:
                self._warned.add(warning)
                guard = "the audit guard" if self.config.audit_guard else "nothing"
                logger.warning(
                    "sandbox manager %r: %s; network access is blocked by %s only",
                    self.name,
                    warning,
                    guard,
                )

    def _verdict(self, run: _Run, tests: Sequence[CodeTest]) -> Verdict:
        self._check_started(run)
        if run.harness_error is not None:
            raise InfraError(f"the sandbox harness failed: {run.harness_error}")
        if run.protocol_error is not None:
            raise InfraError(f"the sandbox's result channel broke: {run.protocol_error}")
        total = len(tests)
        passed = sum(1 for i, r in run.results.items() if r.passed and 0 <= i < total)
        rate = passed / total
        if run.violation is not None:
            return self._fail(f"blocked: {run.violation}", rate, forfeit=True)
        if run.candidate_error is not None:
            kind, outcome = run.candidate_error
            if kind == "syntax":
                reason = f"syntax error in the candidate: {outcome.message}"
            elif outcome.memory:
                reason = "memory limit exceeded (MemoryError) while loading the candidate"
            else:
                reason = f"the candidate raised {outcome.describe()} while loading"
            return self._fail(f"{reason}; 0/{total} tests passed", 0.0)
        if run.done:
            failed = sorted(
                i for i in range(total) if not run.results.get(i, _Outcome(False)).passed
            )
            if not failed:
                return Verdict(1.0, Status.OK, {"pass_rate": 1.0}, f"{total}/{total} tests passed")
            first = failed[0]
            outcome = run.results.get(first, _Outcome(False, "no report"))
            return self._fail(
                f"{passed}/{total} tests passed; test {first + 1} failed: "
                f"{tests[first].label}: {outcome.describe()}",
                rate,
            )
        # The run ended before the harness finished: a limit, a crash or an exit in candidate
        # code (which of the steps is known from the reports so far).
        step = len(run.results)
        if not run.loaded:
            where = "while loading the candidate"
        elif step < total:
            where = f"in test {step + 1} ({tests[step].label})"
        else:
            where = "after the tests"
        return self._fail(f"{self._early_end(run)} {where}; {passed}/{total} tests passed", rate)

    def _early_end(self, run: _Run) -> str:
        if run.timed_out:
            return f"time limit {self.config.time_limit_s} s exceeded"
        if run.flooded:
            return f"the candidate wrote over {RESULT_LIMIT_BYTES} bytes to the result channel"
        out_of_memory = any(hint in run.stderr for hint in MEMORY_HINTS)
        code = run.returncode
        if code is not None and code < 0:
            name = _signal_name(-code)
            if -code == signal.SIGXCPU:
                return f"CPU time limit {self.config.effective_cpu_limit_s} s exceeded"
            if out_of_memory:
                return f"memory limit exceeded (the interpreter died of {name})"
            if -code == signal.SIGKILL:
                return "killed by SIGKILL (the CPU hard limit or the out-of-memory killer)"
            return f"the interpreter crashed ({name})"
        if out_of_memory:
            return f"memory limit exceeded (exit code {code})"
        return f"the candidate ended the interpreter (exit code {code})"

    def _fail(self, message: str, rate: float, *, forfeit: bool = False) -> Verdict:
        """POLICY_FAIL, scoring the pass rate in fraction mode and 0 otherwise; an escape
        attempt (`forfeit`) scores 0 in either mode, whatever tests passed before it."""
        fraction = self.config.score_mode == "fraction" and not forfeit
        return Verdict(rate if fraction else 0.0, Status.POLICY_FAIL, {"pass_rate": rate}, message)
