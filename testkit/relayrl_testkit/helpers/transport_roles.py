"""Runs weight-sync transport scenarios with every sender and receiver in its own process, and
prints what each of them saw as one JSON object (the last line of stdout).

    python -m relayrl_testkit.helpers.transport_roles [--netns] SCENARIOS_JSON

SCENARIOS_JSON is a list of scenarios: {"name", "type", "num_senders", "num_receivers",
"bucket_sizes", "timeout_s", "seed", optional "absent": [receiver ranks never started],
"kill_receiver": [rank, after_bucket] (SIGKILLs itself once it holds that bucket),
"kill_sender": [rank, after_bucket] (SIGKILLs itself once send() of that bucket returned),
"wrong_size": [sender rank, bucket] (sends that bucket one byte too long),
"raise_in_receiver": [rank, bucket] (its caller fails while holding that bucket),
"repeat": transfers in a row (mooncake roles then keep one MooncakeEngine for all),
"linger_s": seconds a failed role stays alive (a trainer keeps running after a failure)}.

`--netns`: we were started by `unshare -n` in a private network namespace; bring up its
loopback first (Mooncake listens on every interface, so its tests run in there).

The runner imports torch and the transports once and forks the roles (before any thread or
process group exists), which keeps a scenario to a second or two on two cores. Every role asks
the kernel to SIGKILL it when the runner dies, so nothing outlives a killed test.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

# c10d prints a C++ stack trace for every store call that meets a dead peer; the scenarios kill
# peers on purpose, and their errors reach the test as TransportErrors anyway.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch

from relayrl.core.ports import free_port
from relayrl.dataplane.transports.base import (
    TransportError,
    TransportSpec,
    open_sink,
    open_source,
)

PR_SET_PDEATHSIG = 1


def bucket_bytes(seed: int, index: int, size: int) -> bytes:
    return random.Random(f"{seed}/{index}").randbytes(size)


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def transfer_specs(spec: TransportSpec, scenario: dict[str, Any]) -> list[TransportSpec]:
    """One spec per transfer of the scenario ("repeat"), each on its own rendezvous port."""
    ports = scenario["ports"]
    return [
        dataclasses.replace(
            spec, transfer_id=f"{spec.transfer_id}-{k}", rendezvous=f"127.0.0.1:{port}"
        )
        for k, port in enumerate(ports)
    ]


def engine_resources(spec: TransportSpec, scenario: dict[str, Any]) -> dict[str, Any]:
    """With several transfers, a mooncake role keeps one engine for all of them."""
    if spec.type != "mooncake" or len(scenario["ports"]) == 1:
        return {}
    from relayrl.dataplane.transports.mooncake import MooncakeEngine

    return {"engine": MooncakeEngine("127.0.0.1")}


def run_sender(spec: TransportSpec, rank: int, scenario: dict[str, Any], out: Connection) -> None:
    wrong, kill = scenario.get("wrong_size"), scenario.get("kill_sender")
    resources = engine_resources(spec, scenario)
    for k, transfer in enumerate(transfer_specs(spec, scenario)):
        with open_sink(transfer, rank, **resources) as sink:
            for index in transfer.buckets_of(rank):
                data = bucket_bytes(scenario["seed"] + k, index, transfer.bucket_sizes[index])
                if wrong == [rank, index]:
                    data += b"!"
                tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                out.send({"event": "sending", "index": index, "at": time.time()})
                try:
                    sink.send(index, tensor)
                except TransportError:
                    out.send({"event": "send_failed", "index": index, "at": time.time()})
                    raise
                if kill == [rank, index]:
                    out.send({"event": "killed", "index": index, "at": time.time()})
                    os.kill(os.getpid(), signal.SIGKILL)


def run_receiver(
    spec: TransportSpec, rank: int, scenario: dict[str, Any], out: Connection
) -> list[list[str]]:
    kill, fail = scenario.get("kill_receiver"), scenario.get("raise_in_receiver")
    resources = engine_resources(spec, scenario)
    transfers = []
    for transfer in transfer_specs(spec, scenario):
        digests = []
        with open_source(transfer, rank, **resources) as source:
            for index in range(transfer.num_buckets):
                view = source.recv(index)
                digests.append(hashlib.sha256(view.numpy()).hexdigest())
                if kill == [rank, index]:
                    out.send({"event": "killed", "index": index, "at": time.time()})
                    os.kill(os.getpid(), signal.SIGKILL)
                if fail == [rank, index]:
                    out.send({"event": "raising", "index": index, "at": time.time()})
                    raise ValueError(f"loading bucket {index} failed")
        transfers.append(digests)
    return transfers


def role_main(spec_json: str, role: str, rank: int, scenario: dict[str, Any], out: Connection):
    die_with_parent()
    spec = TransportSpec.from_json(spec_json)
    started = time.monotonic()
    result: dict[str, Any] = {"ok": True}
    try:
        if role == "sender":
            run_sender(spec, rank, scenario, out)
        else:
            result["sha256"] = run_receiver(spec, rank, scenario, out)
    except TransportError as exc:
        result = {"ok": False, "error_type": "TransportError", "boundary": exc.boundary}
        result |= {"error": str(exc), "bucket_index": exc.bucket_index, "peer": exc.peer}
    except Exception as exc:
        result = {"ok": False, "error_type": type(exc).__name__, "error": repr(exc)}
    result |= {"elapsed_s": time.monotonic() - started, "at": time.time()}
    out.send({"event": "result", **result})
    out.close()
    if not result["ok"]:
        time.sleep(scenario.get("linger_s", 0))


def run_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    scenario = scenario | {"ports": [free_port() for _ in range(scenario.get("repeat", 1))]}
    spec = TransportSpec(
        type=scenario["type"],
        transfer_id=f"{scenario['name']}-{scenario['seed']}",
        num_senders=scenario["num_senders"],
        num_receivers=scenario["num_receivers"],
        bucket_sizes=scenario["bucket_sizes"],
        rendezvous=f"127.0.0.1:{scenario['ports'][0]}",
        timeout_s=scenario["timeout_s"],
    )
    roles = [("sender", s) for s in range(spec.num_senders)]
    absent = set(scenario.get("absent", []))
    roles += [("receiver", r) for r in range(spec.num_receivers) if r not in absent]
    context = multiprocessing.get_context("fork")
    started_at = time.time()
    processes, pipes = {}, {}
    for role, rank in roles:
        name = f"{role} {rank}"
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=role_main, args=(spec.to_json(), role, rank, scenario, writer), name=name
        )
        process.start()
        writer.close()
        processes[name], pipes[name] = process, reader
    events: dict[str, list[dict[str, Any]]] = {name: [] for name in processes}
    limit = time.monotonic() + 3 * spec.timeout_s + 20
    for name, reader in pipes.items():
        while True:
            remaining = limit - time.monotonic()
            if remaining <= 0 or not reader.poll(remaining):
                break
            try:
                event = reader.recv()
            except EOFError:
                break
            events[name].append(event)
            if event["event"] == "result":
                break
    for process in processes.values():
        process.join(max(0.0, limit - time.monotonic()))
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join()
    roles_out = {}
    for name, process in processes.items():
        results = [e for e in events[name] if e["event"] == "result"]
        result = results[0] if results else {"ok": False, "error_type": "no result"}
        result["exitcode"] = process.exitcode
        result["events"] = [e for e in events[name] if e["event"] != "result"]
        roles_out[name] = result
    expected = [
        [
            hashlib.sha256(bucket_bytes(scenario["seed"] + k, i, size)).hexdigest()
            for i, size in enumerate(spec.bucket_sizes)
        ]
        for k in range(len(scenario["ports"]))
    ]
    return {
        "roles": roles_out,
        "expected_sha256": expected,
        "started_at": started_at,
        "wall_s": time.time() - started_at,
    }


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--netns":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        args = args[1:]
    scenarios = json.loads(args[0])
    if any(s["type"] == "mooncake" for s in scenarios):
        import mooncake.engine  # noqa: F401 - load it once, before forking the roles
    results = {scenario["name"]: run_scenario(scenario) for scenario in scenarios}
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
