"""A plain-`openai` external agent: reads its task, asks the model, sends a follow-up user turn,
asks again, and closes its session (reporting `--reward` as the environment's reward, if
given). `--behave` makes it end the other ways agents do: crash (exit 3 before any request),
hang (sleep past any deadline), noclose (one turn, exit 0 without closing: the exit ends the
episode), nogen (exit 0 before any request). `--serve` makes it a served agent (one process
for every task; `serve` says how it behaves)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai


def close_session(
    reward: float | None = None, session_url: str | None = None, api_key: str | None = None
) -> None:
    body = {} if reward is None else {"env_reward": {"status": "ok", "score": reward}}
    request = urllib.request.Request(
        (session_url or os.environ["RELAYRL_SESSION_URL"]) + "/close",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {api_key or os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        response.read()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--behave", choices=["well", "crash", "hang", "noclose", "nogen"], default="well"
    )
    parser.add_argument("--reward", type=float, default=None, help="report this env reward")
    parser.add_argument("--serve", action="store_true", help="a served agent (serve: true)")
    args = parser.parse_args()
    if args.serve:
        return serve()
    task = json.loads(sys.stdin.readline())
    if args.behave == "crash":
        print("boom: the agent fell over", file=sys.stderr)
        return 3
    if args.behave == "hang":
        time.sleep(3600)
    if args.behave == "nogen":
        return 0
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the env
    messages = list(task["messages"])
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    if args.behave == "noclose":
        return 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Once more, please."},
    ]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    close_session(args.reward)
    return 0


def serve() -> int:
    """A served agent: one task per stdin line, on threads, one result line each. The task's
    label `behave` says how: `well` (the default: two turns, close), `error` (reports an
    error), `noclose` (one turn, reports success without closing), `die` (the whole process
    exits 5)."""
    lock = threading.Lock()

    def one(task: dict) -> None:  # type: ignore[type-arg]
        behave = task["labels"].get("behave", "well")
        if behave == "die":
            print("the served agent fell over", file=sys.stderr, flush=True)
            os._exit(5)
        error = None
        try:
            if behave == "error":
                raise RuntimeError("the environment broke")
            client = openai.OpenAI(
                base_url=task["base_url"], api_key=task["api_key"], max_retries=0
            )
            messages = list(task["messages"])
            first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
            if behave != "noclose":
                messages += [
                    {"role": "assistant", "content": first.choices[0].message.content or ""},
                    {"role": "user", "content": "Once more, please."},
                ]
                client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
                close_session(session_url=task["session_url"], api_key=task["api_key"])
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            print(json.dumps({"session_id": task["session_id"], "error": error}), flush=True)

    with ThreadPoolExecutor(16) as pool:
        for line in sys.stdin:
            pool.submit(one, json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())


async def agent(client, task: dict) -> float | None:  # type: ignore[no-untyped-def]
    """The same agent as a coroutine function (`callable:`): one turn, a follow-up, another;
    returning closes the session, with the label `reward` (if any) as the environment's reward.
    A task labelled `behave: raise` raises instead."""
    if task["labels"].get("behave") == "raise":
        raise RuntimeError("the agent function fell over")
    messages = list(task["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Once more, please."},
    ]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    reward = task["labels"].get("reward")
    return float(reward) if reward is not None else None
