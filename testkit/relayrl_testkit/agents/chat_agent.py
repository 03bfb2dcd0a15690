"""A plain-`openai` external agent: reads its task, asks the model, sends a follow-up user turn,
asks again, and closes its session (reporting `--reward` as the environment's reward, if
given). `--behave` makes it misbehave the ways agents do:
crash (exit 3 before any request), hang (sleep past any deadline), noclose (one turn, exit 0
without closing)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

import openai


def close_session(reward: float | None = None) -> None:
    body = {} if reward is None else {"env_reward": {"status": "ok", "score": reward}}
    request = urllib.request.Request(
        os.environ["RELAYRL_SESSION_URL"] + "/close",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        response.read()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--behave", choices=["well", "crash", "hang", "noclose"], default="well")
    parser.add_argument("--reward", type=float, default=None, help="report this env reward")
    args = parser.parse_args()
    task = json.loads(sys.stdin.readline())
    if args.behave == "crash":
        print("boom: the agent fell over", file=sys.stderr)
        return 3
    if args.behave == "hang":
        time.sleep(3600)
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
