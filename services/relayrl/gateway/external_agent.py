"""External agents: a program of the user's, started once per sample of a claimed group, that
talks to the gateway's OpenAI-compatible agent endpoint like any client
(docs/architecture.md#external-agents).

A group whose `agent` names an entry of `agents.external` is rolled out by the same claim loop
as the built-in loops (relayrl.gateway.rollout: throttle, leases, exactly-once puts). For each
missing sample the runner

1. opens an agent session bound to the claimed sample (its group's data_source and ground
   truth stay in the TransferQueue: the agent never sees or sets them);
2. starts the command in a process group of its own with `OPENAI_BASE_URL` (the session's
   `/v1`), `OPENAI_API_KEY` (the session's own token), `RELAYRL_SESSION_URL` (for the close)
   and the task on stdin as one JSON object: `{"session_id", "messages", "labels",
   "sample_index"}`;
3. waits for it, up to `deadline_s`, then kills the whole process group.

With `serve: true` one long-running process takes every sample's task instead (one JSON line
per task in, one result line per task out: relayrl.gateway.served_agent), so the program's
start-up is paid once.

An agent that exits 0 has finished: its session is closed for it (no environment reward), the
trajectory is what the policy generated, and the reward-service scores it as any other. An
agent may also end its session itself with `POST $RELAYRL_SESSION_URL/close`, which is how it
reports an environment's reward.

The task also holds `extra_info`, the dataset row's object (empty for other tasks). A close may
report the environment's reward (`{"env_reward": {"status", "score", "message"}}`), which the
reward-service's `env` manager uses (docs/rewards.md#environment-rewards).

An agent may also be a coroutine function (`callable: package.module:function`), awaited in the
gateway as `await function(client, task)` with an `openai.AsyncOpenAI` client on the session;
its return closes the session (a returned number or `{"status", "score", "message"}` is the
environment's reward), an exception or the deadline fails it. Every other ending is the
infrastructure's, never a reward: an agent that exits non-zero, is killed, runs past its
deadline, or exits 0 with no generation, with a request still in flight or right after its
last request failed on our side (frameworks catch a 502 and exit 0 anyway) gets its session
aborted, and the trajectory is put as failed (is_infra) with the reason (exit code, stderr
tail) - also when it generated nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relayrl.core.config import ConfigError
from relayrl.core.dotted import import_object
from relayrl.core.env_reward import EnvReward
from relayrl.gateway.agent_http.domain import SessionSpec
from relayrl.gateway.agent_http.errors import AgentError
from relayrl.gateway.agent_http.protocol.checks import check_env_reward
from relayrl.gateway.served_agent import AgentServer, kill_group

if TYPE_CHECKING:
    from relayrl.gateway.agent_http.sessions import AgentSessions
    from relayrl.gateway.config import ExternalAgentConfig
    from relayrl.tq import ClaimedGroup

logger = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000
EXTRA_INFO_LABEL = "extra_info"  # as relayrl.tasks.datasets writes it
# The environment an agent gets from the gateway's own: enough to run a program, no secrets.
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")


@dataclass(frozen=True)
class AgentRun:
    """How one sample's agent ended: `finished` (its session ended as a close), or the reason the
    trajectory was failed; `needs_put` when the session had nothing to put (the caller puts a
    failed trajectory)."""

    finished: bool
    reason: str = ""
    needs_put: bool = False


def agent_environment(
    base: Mapping[str, str],
    extra: Mapping[str, str],
    *,
    session_url: str | None = None,
    token: str | None = None,
) -> dict[str, str]:
    """What an agent process runs with: a few of the gateway's variables, the configured ones
    and, for a process of one sample, its session's URL and token."""
    env = {name: base[name] for name in PASSED_ENV if name in base}
    env.update(extra)
    if session_url is not None and token is not None:
        env.update(
            OPENAI_BASE_URL=f"{session_url}/v1",
            OPENAI_API_KEY=token,
            RELAYRL_SESSION_URL=session_url,
        )
    return env


class ExternalAgent:
    """One configured external agent (`agents.external.<name>`)."""

    def __init__(
        self,
        name: str,
        config: ExternalAgentConfig,
        sessions: AgentSessions,
        endpoint: Callable[[], str],
    ) -> None:
        """`endpoint()`: the agent endpoint's base URL as the agents reach it (known once the
        endpoint serves)."""
        self.name = name
        self.config = config
        self._sessions = sessions
        self._endpoint = endpoint
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._function = None
        self._server: AgentServer | None = None
        if config.serve:
            assert config.command is not None
            self._server = AgentServer(
                name, config.command, agent_environment(os.environ, config.env), config.cwd
            )
        if config.callable is not None:
            try:
                self._function = import_object(config.callable, f"agents.external.{name}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self._function is not None and not inspect.iscoroutinefunction(self._function):
            raise ConfigError(
                f"agents.external.{name}.callable {config.callable!r} is not an async function"
            )

    async def run_sample(self, claim: ClaimedGroup, index: int) -> AgentRun:
        group = claim.group
        spec = SessionSpec(
            partition=group.partition, uid=group.uid, index=index, claim_id=claim.claim_id
        )
        async with self._slots:
            session = await self._sessions.open(spec)
            session_id = session.session_id
            token = self._sessions.tokens.mint(session_id, None)
            session_url = f"{self._endpoint()}/sessions/{session_id}"
            task = {
                "session_id": session_id,
                "messages": [
                    {k: v for k, v in (("role", m.role), ("content", m.content)) if v}
                    for m in group.messages
                ],
                "labels": dict(group.labels),
                "extra_info": _extra_info(group.labels),
                "sample_index": index,
            }
            if self._function is not None:
                reason = await self._run_function(task, session_id, session_url, token)
            elif self._server is not None:
                task |= {"base_url": f"{session_url}/v1", "api_key": token}
                task["session_url"] = session_url
                reason = await self._server.run(task, self.config.deadline_s)
            else:
                env = agent_environment(
                    os.environ, self.config.env, session_url=session_url, token=token
                )
                reason = await self._run_process(task, env)
        ended = self._sessions.ended(session_id)
        if reason is None and ended is None:  # done without a close: the episode is over
            done = "finished its task" if self._server is not None else "exited 0"
            try:
                ended = await self._sessions.end_on_exit(session_id, f"agent {self.name!r} {done}")
            except AgentError as exc:
                reason = f"agent {self.name!r} {done}, but its session did not end: {exc.message}"
        if reason is None and ended is not None:
            if ended.outcome == "finished":
                return AgentRun(finished=True)
            reason = ended.reason
            if not reason.startswith(f"agent {self.name!r}"):
                reason = f"agent {self.name!r} ended its session as {ended.outcome}: {reason}"
        assert reason is not None
        if ended is None:
            with contextlib.suppress(AgentError):
                ended = await self._sessions.abort(session_id, reason)
        logger.warning("agent %s on %s_%d: %s", self.name, group.uid, index, reason)
        # A session that generated nothing is discarded, not put: the caller puts the failure.
        needs_put = ended is None or ended.outcome == "discarded"
        return AgentRun(finished=False, reason=reason, needs_put=needs_put)

    async def close(self) -> None:
        """Stops a served agent's process (a process-per-sample agent has none left)."""
        if self._server is not None:
            await self._server.close()

    async def _run_function(
        self, task: dict[str, object], session_id: str, session_url: str, token: str
    ) -> str | None:
        """Awaits the agent function to its end or its deadline and closes the session when
        it returns; None when it did, else why not."""
        import openai

        assert self._function is not None
        client = openai.AsyncOpenAI(base_url=f"{session_url}/v1", api_key=token, max_retries=0)
        try:
            async with asyncio.timeout(self.config.deadline_s):
                returned = await self._function(client, task)
        except TimeoutError:
            return f"agent {self.name!r} ran past its deadline of {self.config.deadline_s} s"
        except Exception as exc:
            return f"agent {self.name!r} raised {type(exc).__name__}: {exc}"[:STDERR_TAIL_CHARS]
        finally:
            await client.close()
        if self._sessions.ended(session_id) is None:
            try:
                reward = returned_reward(returned)
                await self._sessions.close_session(session_id, env_reward=reward)
            except AgentError as exc:
                return f"agent {self.name!r} returned, but its session did not close: {exc.message}"
        return None

    async def _run_process(self, task: dict[str, object], env: dict[str, str]) -> str | None:
        """Runs the command to its end or its deadline; None when it exited 0, else why not."""
        command: Sequence[str] = self.config.command or ()
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=self.config.cwd,
                start_new_session=True,
            )
        except OSError as exc:
            return f"agent {self.name!r} could not start ({command[0]}): {exc.strerror or exc}"
        stderr = asyncio.ensure_future(_tail(process.stderr, STDERR_TAIL_CHARS))
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                assert process.stdin is not None
                process.stdin.write(json.dumps(task).encode() + b"\n")
                await process.stdin.drain()
                process.stdin.close()
            try:
                async with asyncio.timeout(self.config.deadline_s):
                    code = await process.wait()
            except TimeoutError:
                return f"agent {self.name!r} ran past its deadline of {self.config.deadline_s} s"
        finally:
            kill_group(process)  # whatever it started goes with it, on cancellation too
            await process.wait()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(stderr), 5.0)
            stderr.cancel()
        if code == 0:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
        tail = stderr.result() if stderr.done() and not stderr.cancelled() else ""
        return f"agent {self.name!r} {how}" + (f": {tail}" if tail else "")


def returned_reward(returned: object) -> EnvReward | None:
    """What an agent function returned, as its environment reward: None (no reward), a number
    (`ok` with that score) or `{"status", "score", "message"}`; AgentError(INVALID) otherwise."""
    if returned is None:
        return None
    if isinstance(returned, int | float) and not isinstance(returned, bool):
        returned = {"status": "ok", "score": returned}
    return check_env_reward(returned, "the returned env_reward")


def _extra_info(labels: Mapping[str, str]) -> dict[str, object]:
    """A dataset row's `extra_info` object (relayrl.tasks.datasets keeps it as a JSON label)."""
    try:
        value = json.loads(labels.get(EXTRA_INFO_LABEL, "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def _tail(stream: asyncio.StreamReader | None, limit: int) -> str:
    """The last `limit` characters of a stream, read to its end."""
    if stream is None:
        return ""
    kept = b""
    while chunk := await stream.read(1 << 16):
        kept = (kept + chunk)[-limit * 4 :]
    text = kept.decode("utf-8", "replace").strip()
    return text[-limit:]
