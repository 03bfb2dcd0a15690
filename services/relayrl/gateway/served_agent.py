"""A served external agent (`agents.external.<name>.serve: true`): one long-running process
that takes every sample's task, instead of one process per sample.

Starting a process per sample costs the program's start-up every time: Python and its imports,
about a CPU-second for `openai` or an agent framework. A served agent pays it once:

- the gateway starts the command (in a process group of its own, with the variables an
  external agent gets, but no session's) when the first task comes, and again after it dies;
- each task is one JSON line on its stdin: the per-sample task of a process-per-sample agent
  plus that sample's `base_url` (its session's OpenAI `/v1`), `api_key` (the session's token)
  and `session_url` (for the close);
- for each task it writes one JSON line on stdout once it is done with it:
  `{"session_id": ..., "error": null | "what went wrong"}`; other stdout lines are ignored.
  `"error": null` ends the episode as an agent's exit 0 does (the session is closed for it,
  unless it already closed it with a reward); an error fails it as the infrastructure's.

It runs tasks concurrently, as many as `max_concurrent` at a time. A task past its deadline
fails alone; the process keeps running, and its late requests on that session are refused.
When the process exits, every task it held fails with its exit code and stderr tail, and the
next task starts it again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000
MAX_LINE_BYTES = 1 << 20


class AgentServer:
    def __init__(
        self, name: str, command: Sequence[str], env: Mapping[str, str], cwd: str | None
    ) -> None:
        self.name = name
        self._command = list(command)
        self._env = dict(env)
        self._cwd = cwd
        self._process: asyncio.subprocess.Process | None = None
        self._pending: dict[str, asyncio.Future[str | None]] = {}
        self._stderr = ""
        self._readers: list[asyncio.Task[None]] = []
        self._start_lock = asyncio.Lock()
        self._closed = False

    async def run(self, task: dict[str, Any], deadline_s: float) -> str | None:
        """Hands `task` to the process and waits for its result line, up to `deadline_s`;
        None when it reported success, else why not."""
        session_id = str(task["session_id"])
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._pending[session_id] = done
        try:
            async with asyncio.timeout(deadline_s):
                try:
                    process = await self._started()
                except OSError as exc:
                    return f"agent {self.name!r} could not start ({self._command[0]}): {exc}"
                assert process.stdin is not None
                try:
                    process.stdin.write(json.dumps(task).encode() + b"\n")
                    await process.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it is exiting: its reader ends the task with the exit status
                return await done
        except TimeoutError:
            return f"agent {self.name!r} ran past its deadline of {deadline_s} s"
        finally:
            self._pending.pop(session_id, None)

    async def close(self) -> None:
        self._closed = True
        process = self._process
        if process is not None and process.returncode is None:
            kill_group(process)
            await process.wait()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    async def _started(self) -> asyncio.subprocess.Process:
        async with self._start_lock:
            if self._closed:
                raise OSError("the gateway is shutting down")
            if self._process is not None and self._process.returncode is None:
                return self._process
            process = await asyncio.create_subprocess_exec(
                *self._command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
                cwd=self._cwd,
                start_new_session=True,
                limit=MAX_LINE_BYTES,
            )
            logger.info("agent %s serving as process %d", self.name, process.pid)
            self._process = process
            self._stderr = ""
            stderr = asyncio.create_task(self._read_stderr(process), name=f"agent-{self.name}-err")
            results = self._read_results(process, stderr)
            self._readers = [stderr, asyncio.create_task(results, name=f"agent-{self.name}-out")]
            return process

    async def _read_results(
        self, process: asyncio.subprocess.Process, stderr: asyncio.Task[None]
    ) -> None:
        assert process.stdout is not None
        while True:
            try:
                line = await process.stdout.readline()
            except ValueError:  # a line over MAX_LINE_BYTES: not a result line
                continue
            if not line:
                break
            self._settle(line)
        code = await process.wait()
        with contextlib.suppress(TimeoutError):  # the last words reach the stderr tail
            await asyncio.wait_for(asyncio.shield(stderr), 1.0)
        how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
        tail = self._stderr.strip()
        reason = f"agent {self.name!r} process {how}" + (f": {tail}" if tail else "")
        if not self._closed:
            logger.warning("%s", reason)
        for future in list(self._pending.values()):
            if not future.done():
                future.set_result(reason)

    def _settle(self, line: bytes) -> None:
        try:
            result = json.loads(line)
        except ValueError:
            return
        if not isinstance(result, dict):
            return
        future = self._pending.get(str(result.get("session_id")))
        if future is None or future.done():
            return
        error = result.get("error")
        future.set_result(
            f"agent {self.name!r} reported: {error}"[:STDERR_TAIL_CHARS] if error else None
        )

    async def _read_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.read(1 << 16):
            text = self._stderr + chunk.decode("utf-8", "replace")
            self._stderr = text[-STDERR_TAIL_CHARS:]


def kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
