"""Checks of examples/agents/verifiers_agent.py run inside the verifiers virtual environment
(test_verifiers_agent.py starts this file with its interpreter; verifiers cannot be imported in
relayrl's). Each check prints `ok <name>`; the first failure raises.

The model endpoint here is a loopback HTTP server that answers as a relayrl session does and
refuses as strictly: a wrong path, a wrong or missing bearer token, a malformed body, or a
conversation that does not extend the previous request. The real gateway is in
tests/integration/gateway/test_gateway_external_agents.py and tests/integration/up/."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "agents"
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES / "verifiers_env")]

import verifiers.v1 as vf  # noqa: E402
import verifiers_agent as agent  # noqa: E402


class Session:
    """One session of a strict relayrl-like endpoint: its token, its turns, its close."""

    def __init__(self, session_id: str, replies: list[str]) -> None:
        self.session_id = session_id
        self.token = f"token-{session_id}"
        self.replies = list(replies)
        self.requests: list[list[dict[str, Any]]] = []
        self.closed: dict[str, Any] | None = None


class Endpoint:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.app = web.Application()
        self.app.router.add_post("/sessions/{sid}/v1/chat/completions", self.chat)
        self.app.router.add_post("/sessions/{sid}/close", self.close)
        self.url = ""

    async def __aenter__(self) -> Endpoint:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    def open(self, session_id: str, replies: list[str]) -> dict[str, Any]:
        session = self.sessions[session_id] = Session(session_id, replies)
        base = f"{self.url}/sessions/{session_id}"
        return {"base_url": f"{base}/v1", "api_key": session.token, "session_url": base}

    def _session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise web.HTTPNotFound(text="unknown session")
        if request.headers.get("Authorization") != f"Bearer {session.token}":
            raise web.HTTPUnauthorized(text="wrong token")
        if session.closed is not None:
            raise web.HTTPUnauthorized(text="session closed")
        return session

    async def chat(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise web.HTTPBadRequest(text="messages")
        if session.requests:  # a later request extends the conversation exactly
            previous = session.requests[-1]
            if messages[: len(previous)] != previous:
                raise web.HTTPConflict(text="conversation_diverged")
        reply = session.replies.pop(0)
        session.requests.append([*messages, {"role": "assistant", "content": reply}])
        return web.json_response(
            {
                "id": f"chatcmpl-{session.session_id}-{len(session.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": reply},
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def close(self, request: web.Request) -> web.Response:
        session = self._session(request)
        session.closed = await request.json()
        return web.json_response({"session_id": session.session_id, "outcome": "finished"})


def check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok {name}", flush=True)


def refuses(name: str, call: Any, words: str) -> None:
    try:
        call()
    except Exception as exc:  # the check is on the message
        check(name, words in str(exc), str(exc))
        return
    raise AssertionError(f"{name}: no error")


async def main() -> None:
    config = agent.env_config("vf-arith", {})
    rows = list(agent.export_rows(config, None))
    first = rows[0]
    check("export: one row per task", len(rows) == 64, len(rows))
    check("export: verl layout", first["data_source"] == "verifiers/vf-arith", first)
    check("export: the prompt", first["prompt"][0]["role"] == "user", first["prompt"])
    info = first["extra_info"]["verifiers"]
    check("export: where the task is", info["taskset"] == "vf-arith" and info["idx"] == 0, info)

    tasks = agent.Tasks(config)
    found = tasks.find(rows[5]["extra_info"])
    check(
        "find: by index",
        found.data.idx == 5 and found.key == rows[5]["extra_info"]["verifiers"]["key"],
    )
    refuses("find: no extra_info", lambda: tasks.find({}), "no extra_info.verifiers.idx")
    other = {"verifiers": {**info, "taskset": "other"}}
    refuses("find: another taskset", lambda: tasks.find(other), "taskset 'other'")
    beyond = {"verifiers": {**info, "idx": 10_000}}
    refuses("find: past the end", lambda: tasks.find(beyond), "has no task 10000")
    changed = {"verifiers": {**info, "key": "0" * 64}}
    refuses("find: a changed task", lambda: tasks.find(changed), "changed since the dataset")
    retried = {"retries": {"max_retries": 1}}
    refuses("config: retries", lambda: agent.env_config("vf-arith", retried), "retries")
    seat_retried = {"agent": {"retries": {"max_retries": 1}}}
    refuses(
        "config: a seat's retries", lambda: agent.env_config("vf-arith", seat_retried), "retries"
    )

    async with Endpoint() as endpoint:
        serving = agent.Serving(config)
        answer = found.data.answer
        # the harness asks once more when the first reply has no answer: two turns
        task = {"session_id": "s1", **endpoint.open("s1", ["hmm", f"Answer: {answer}"])}
        task["extra_info"] = rows[5]["extra_info"]
        reward = await agent.solve(task, tasks, serving)
        session = endpoint.sessions["s1"]
        check("solve: two turns on the session", len(session.requests) == 2, session.requests)
        concise = 0.1 / (1 + len(f"Answer: {answer}") / 100)
        expected = {"status": "ok", "score": 1.0 + 0.1 + concise}
        check("solve: the rubric, reported with the close", session.closed == {"env_reward": reward}
              and reward["status"] == "ok" and abs(reward["score"] - expected["score"]) < 1e-9,
              (session.closed, expected))  # fmt: skip
        check("solve: the session's key is not left behind",
              not any(k.startswith("RELAYRL_SESSION_KEY_") for k in os.environ))  # fmt: skip

        # renewal: at most RENEW_AFTER episodes per interception server; the old one closes
        agent.RENEW_AFTER = 2
        generations: list[Any] = []
        original = agent._Generation

        def counted(config: vf.EnvConfig) -> Any:
            generations.append(original(config))
            return generations[-1]

        agent._Generation = counted  # type: ignore[misc]
        await serving.close()
        serving = agent.Serving(config)
        many = []
        for i in range(5):
            sid = f"r{i}"
            many.append({"session_id": sid, **endpoint.open(sid, [f"Answer: {answer}"])})
            many[-1]["extra_info"] = rows[5]["extra_info"]
        results = await asyncio.gather(*(agent.solve(t, tasks, serving) for t in many))
        check("renew: every episode scored", all(r["status"] == "ok" for r in results), results)
        check("renew: three servers for five episodes", len(generations) == 3, len(generations))
        check("renew: the old ones closed", all(g._holder.done() for g in generations[:-1]))
        await serving.close()
        check("renew: the last one closes with the agent", generations[-1]._holder.done())

    # an episode the environment fails is an error with its reason, never a reward
    async with Endpoint() as endpoint:
        for extra, words in (
            ({"timeout": {"episode": 0.000001}}, "TimeoutError: SingleAgentEnv.run() exceeded"),
            (
                {"agent": {"timeout": {"scoring": 0.000001}}},
                "has no reward (its scoring timed out)",
            ),
        ):
            broken = agent.env_config("vf-arith", extra)
            serving = agent.Serving(broken)
            task = {"session_id": "b", **endpoint.open("b", ["Answer: 1", "Answer: 1"])}
            task["extra_info"] = rows[0]["extra_info"]
            reward = await agent.solve(task, agent.Tasks(broken), serving)
            await serving.close()
            check(f"error: {words}", reward["status"] == "error" and words in reward["message"]
                  and endpoint.sessions["b"].closed == {"env_reward": reward}, reward)  # fmt: skip

    # the command line: a bad id or config is one line and exit 2
    for argv, words in (
        (["--taskset", "no-such-env"], "taskset 'no-such-env' not found"),
        (["--taskset", "vf-arith", "--env-config", "[1]"], "not a JSON object"),
    ):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = agent.main(argv)
        line = stderr.getvalue()
        check(f"cli: {words}", code == 2 and words in line and line.count("\n") == 1, line)


if __name__ == "__main__":
    asyncio.run(main())
