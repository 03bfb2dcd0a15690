"""A `verifiers` environment (prime-rl's environment library, verifiers 0.4) as a relayrl agent:
the environment runs its own rollout, with its model client pointed at the sample's session, and
its rubric's reward goes back with the session's close as the environment's reward.

verifiers needs `openai<3` and about a hundred packages, so `make setup` builds it its own
virtual environment (.venv/share/venvs/verifiers, pinned by requirements-verifiers.txt); this
file imports nothing of relayrl. Two steps:

    # 1. the taskset's tasks as a dataset relayrl can train on
    $VF_PYTHON examples/agents/verifiers_agent.py export --taskset my-env > my-env.jsonl
    # 2. train on it, each sample rolled out by the environment (served: one process)
    relayrl up --data my-env.jsonl --env-reward --agent-serve --agent \\
        "$VF_PYTHON examples/agents/verifiers_agent.py --taskset my-env --serve"

with VF_PYTHON=.venv/share/venvs/verifiers/bin/python.

`--taskset` is a verifiers taskset id: an installed package (or one on PYTHONPATH) whose
`__all__` exports its `Taskset` (and, optionally, its own `Harness` and `Env`), as the
`verifiers` CLI loads it. `--env-config` adds JSON to the environment's config, e.g.
'{"agent": {"harness": {"id": "null"}}}' for verifiers' own chat harness. The agent's runtime
defaults to `subprocess` (the agent's own machine or pod): verifiers' default is a remote Prime
sandbox, which needs an account. Its built-in program harnesses (`null`, `bash`, ...) install
their script's dependencies with `uv` at first use, so they need a package index.

Each exported row keeps the task's place in the taskset (`extra_info.verifiers`: taskset id,
index, content key) and the prompt the environment will send, so that the prompt group relayrl
trains on is the conversation the environment starts. The agent finds the task by index and
refuses one whose key changed (the taskset's data changed since the export).

What the environment's episode becomes:
- it completed: `env_reward` `{"status": "ok", "score": <the sum of its traces' rewards>}`;
- it failed (a harness, runtime, interception or timeout error, or a reward that did not run):
  `{"status": "error", "message": <its last error>}`. relayrl then puts the trajectory as an
  infrastructure failure, never as a reward of 0;
- a task it cannot start (no `extra_info.verifiers`, a changed key) fails the sample with that
  reason, as any agent error does.
The reward-service uses the reported reward for the data sources routed to its `env` manager
(`relayrl up --env-reward` routes every one; docs/rewards.md#environment-rewards).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from tools import close_session, session_of
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.types import content_text

MODEL = "policy"  # the session serves one policy, whatever name a request gives
TASK_INFO = "verifiers"  # the key of extra_info that names the task
RENEW_AFTER = 256  # episodes per interception server (see Serving)
MAX_MESSAGE_CHARS = 1000  # as relayrl.core.env_reward accepts


def env_config(taskset: str, extra: dict[str, Any]) -> vf.EnvConfig:
    """The environment's config: the taskset, run on this machine unless `extra` says where.
    ValueError for retries: a sample is one session, which a retried episode would continue;
    a failed episode goes back to relayrl as an environment error instead."""
    config: dict[str, Any] = {"taskset": {"id": taskset}}
    config["agent"] = {"runtime": {"type": "subprocess"}}
    resolved = vf.resolve_env_config(_merged(config, extra))
    seats = [resolved, *agent_config_fields(resolved).values()]
    if any(seat.retries.max_retries or seat.retries.rules for seat in seats):
        raise ValueError(
            "retries: one sample is one relayrl session, which a retried episode would "
            "continue; leave them off (relayrl refills a sample whose environment failed)"
        )
    return resolved


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def prompt_messages(data: vf.TaskData) -> list[dict[str, str]]:
    """The task's opening conversation in relayrl's row layout (text content)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    for message in data.prompt or []:
        messages.append({"role": message.role, "content": content_text(message.content) or ""})
    return messages


def export_rows(config: vf.EnvConfig, limit: int | None) -> Iterator[dict[str, Any]]:
    """One relayrl dataset row (verl layout) per task of the taskset."""
    taskset = vf.load_taskset(config.taskset)
    if limit is not None:
        taskset = taskset.take(limit)
    elif not taskset.bounded:
        raise SystemExit(f"taskset {config.taskset.id!r} is infinite: give --limit")
    for task in taskset:
        messages = prompt_messages(task.data)
        if not any(m["content"] for m in messages):
            raise SystemExit(f"task {task.data.idx} has no text prompt; relayrl needs one")
        yield {
            "data_source": f"verifiers/{config.taskset.id}",
            "prompt": messages,
            # the environment scores; relayrl's rule scorers never see this row
            "reward_model": {"ground_truth": ""},
            "extra_info": {
                TASK_INFO: {"taskset": config.taskset.id, "idx": task.data.idx, "key": task.key}
            },
        }


class Tasks:
    """The taskset's tasks by index, read as far as needed (a taskset may be a generator)."""

    def __init__(self, config: vf.EnvConfig) -> None:
        self._taskset_id = config.taskset.id
        self._stream = iter(vf.load_taskset(config.taskset))
        self._read: list[vf.Task] = []

    def find(self, extra_info: dict[str, Any]) -> vf.Task:
        info = extra_info.get(TASK_INFO)
        if not isinstance(info, dict) or not isinstance(info.get("idx"), int):
            raise ValueError(
                f"the sample has no extra_info.{TASK_INFO}.idx; train on rows written by "
                "`verifiers_agent.py export`"
            )
        if info.get("taskset") != self._taskset_id:
            raise ValueError(
                f"the sample is a task of taskset {info.get('taskset')!r}, this agent runs "
                f"{self._taskset_id!r}"
            )
        idx = info["idx"]
        while len(self._read) <= idx:
            task = next(self._stream, None)
            if task is None:
                raise ValueError(f"taskset {self._taskset_id!r} has no task {idx}")
            self._read.append(task)
        task = self._read[idx]
        if info.get("key") != task.key:
            raise ValueError(
                f"task {idx} of {self._taskset_id!r} changed since the dataset was exported "
                "(its key differs); export it again"
            )
        return task


class Serving:
    """The environment's serving resources (the interception server its harnesses call, and
    its shared tool servers), renewed every RENEW_AFTER episodes.

    Each session has its own URL and token, and verifiers keeps one HTTP client per endpoint
    for as long as its interception server lives: renewing bounds what a long run holds. An
    old generation closes when its last episode ends. Each generation is held open by a task
    of its own, because the resources must be closed by the task that opened them."""

    def __init__(self, config: vf.EnvConfig) -> None:
        self._config = config
        self._current: _Generation | None = None

    async def run(self, task: vf.Task, ctx: vf.ModelContext) -> vf.Episode:
        if self._current is None or self._current.episodes >= RENEW_AFTER:
            old, self._current = self._current, _Generation(self._config)
            if old is not None and old.active == 0:
                await old.close()
        generation = self._current
        generation.episodes += 1
        generation.active += 1
        try:
            await generation.ready()
            return await generation.env.run_episode(task, ctx)
        finally:
            generation.active -= 1
            if generation is not self._current and generation.active == 0:
                await generation.close()

    async def close(self) -> None:
        if self._current is not None:
            await self._current.close()


class _Generation:
    def __init__(self, config: vf.EnvConfig) -> None:
        self.env = vf.load_environment(config)
        self.episodes = 0
        self.active = 0
        self._opened = asyncio.Event()
        self._closing = asyncio.Event()
        self._holder = asyncio.create_task(self._hold())

    async def _hold(self) -> None:
        async with self.env.serving():
            self._opened.set()
            await self._closing.wait()

    async def ready(self) -> None:
        opened = asyncio.create_task(self._opened.wait())
        await asyncio.wait((opened, self._holder), return_when=asyncio.FIRST_COMPLETED)
        opened.cancel()
        if self._holder.done():  # it could not start: its exception says why
            self._holder.result()
            raise RuntimeError("the environment's serving resources closed")

    async def close(self) -> None:
        self._closing.set()
        await asyncio.gather(self._holder, return_exceptions=True)


def env_reward(episode: vf.Episode) -> dict[str, Any]:
    """The close's `env_reward` for a finished episode: its traces' rewards when every trace
    was scored, else the error. A trace with no reward at all (its scoring timed out, or the
    task has no rubric) is an error too: verifiers would sum it as 0."""
    unscored = [t for t in episode.traces if not t.rewards or None in t.rewards.values()]
    if episode.ok and not unscored:
        return {"status": "ok", "score": float(sum(t.reward for t in episode.traces))}
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors:
        message = f"{errors[-1].type}: {errors[-1].message}"
    elif unscored:
        timed_out = " (its scoring timed out)" if unscored[0].is_timeout else ""
        message = f"a trace of the episode has no reward{timed_out}"
    else:
        message = "the episode did not complete and reported no error"
    return {"status": "error", "score": 0.0, "message": message[:MAX_MESSAGE_CHARS]}


async def solve(task: dict[str, Any], tasks: Tasks, serving: Serving) -> dict[str, Any]:
    """Runs the task's episode on its session and closes the session with its reward."""
    vf_task = tasks.find(task.get("extra_info") or {})
    session = session_of(task)
    # verifiers reads an endpoint's key from a variable; one per session, as sessions overlap
    key_var = f"RELAYRL_SESSION_KEY_{secrets.token_hex(8)}"
    os.environ[key_var] = session["api_key"]
    try:
        client = vf.EvalClientConfig(base_url=session["base_url"], api_key_var=key_var)
        episode = await serving.run(vf_task, vf.ModelContext(model=MODEL, client=client))
    finally:
        os.environ.pop(key_var, None)
    reward = env_reward(episode)
    await asyncio.to_thread(close_session, session, reward)
    return reward


async def serve(tasks: Tasks, serving: Serving) -> None:
    """A served agent (`serve: true`): one task per stdin line, each run concurrently on this
    process's event loop, one result line per task on stdout."""
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()

    async def one(task: dict[str, Any]) -> None:
        try:
            await solve(task, tasks, serving)
            error = None
        except Exception as exc:  # reported for this task; the others go on
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"session_id": task["session_id"], "error": error}), flush=True)

    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip():
                runner = asyncio.create_task(one(json.loads(line)))
                running.add(runner)
                runner.add_done_callback(running.discard)
        await asyncio.gather(*running)
    finally:
        await serving.close()


async def run_one(config: vf.EnvConfig) -> None:
    serving = Serving(config)
    try:
        await solve(json.loads(sys.stdin.readline()), Tasks(config), serving)
    finally:
        await serving.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("export",), help="write dataset rows")
    parser.add_argument("--taskset", required=True, help="verifiers taskset id")
    parser.add_argument("--env-config", default="{}", help="JSON merged into the env config")
    parser.add_argument("--limit", type=int, help="export: the first N tasks")
    parser.add_argument("--serve", action="store_true", help="take every sample's task")
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.env_config)
        if not isinstance(extra, dict):
            raise ValueError("not a JSON object")
        config = env_config(args.taskset, extra)
    except Exception as exc:  # a bad id or config is a line, not a traceback
        print(f"verifiers_agent: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.command == "export":
        for row in export_rows(config, args.limit):
            print(json.dumps(row))
        return 0
    if args.serve:
        asyncio.run(_serve(config))
    else:
        asyncio.run(run_one(config))
    return 0


async def _serve(config: vf.EnvConfig) -> None:
    await serve(Tasks(config), Serving(config))


if __name__ == "__main__":
    sys.exit(main())
