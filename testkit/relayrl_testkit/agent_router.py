"""A served agent that hands each task to one of several served agent programs, so that one
`relayrl up` run trains them all: the suite pays a run's start-up (the stack, the engine, the
warm start, the evaluations) once for every agent framework it trains.

    python -m relayrl_testkit.agent_router --log FILE NAME=COMMAND [NAME=COMMAND ...]

Each COMMAND is a served agent as `relayrl up --agent-serve` runs it (one JSON task per line on
its stdin, one result line per task on its stdout; relayrl.gateway.served_agent), started once
and unchanged. Tasks go to the programs in turn, so that every group has samples of each (a
group's prompt may come back, replayed by the curriculum, and its task carries no group id).
Every hand-over is appended to FILE as
`{"session_id": ..., "agent": NAME}`, so that a test can tell whose trajectory is whose.

Result lines pass through as the programs write them. When a program exits, the router exits
with its code: the gateway then fails the tasks it held, as it would the program's own, and
starts the router again. Killing the router's process group (what the gateway does) ends
every program, since they stay in it."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO


def parse_routes(specs: list[str]) -> dict[str, list[str]]:
    routes: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command.strip():
            raise SystemExit(f"agent_router: {spec!r} is not NAME=COMMAND")
        routes[name] = shlex.split(command)
    return routes


def pass_results(source: IO[bytes], lock: threading.Lock) -> None:
    for line in source:
        with lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()


def watch(name: str, process: subprocess.Popen[bytes], closing: threading.Event) -> None:
    code = process.wait()
    if not closing.is_set():
        print(f"agent_router: {name} exited {code}", file=sys.stderr, flush=True)
        os._exit(code or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("routes", nargs="+", metavar="NAME=COMMAND")
    args = parser.parse_args()
    routes = parse_routes(args.routes)
    lock = threading.Lock()
    closing = threading.Event()
    programs: dict[str, subprocess.Popen[bytes]] = {}
    passing: list[threading.Thread] = []
    for name, command in routes.items():
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        programs[name] = process
        passer = threading.Thread(target=pass_results, args=(process.stdout, lock), daemon=True)
        passer.start()
        passing.append(passer)
        threading.Thread(target=watch, args=(name, process, closing), daemon=True).start()
    turns = itertools.cycle(routes)
    with args.log.open("a") as log:
        for line in sys.stdin.buffer:
            task = json.loads(line)
            name = next(turns)
            log.write(json.dumps({"session_id": task["session_id"], "agent": name}) + "\n")
            log.flush()
            stdin = programs[name].stdin
            assert stdin is not None
            stdin.write(line)
            stdin.flush()
    closing.set()
    for process in programs.values():  # the gateway closed our stdin: theirs too
        assert process.stdin is not None
        process.stdin.close()
    for process in programs.values():
        process.wait()
    for passer in passing:  # a program's last results may still be on their way through
        passer.join()


if __name__ == "__main__":
    main()
