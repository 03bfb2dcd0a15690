"""Throughput of the data-plane transports on this machine, for a bench script to print side by
side with the physical limit (loopback TCP between two processes).

    measure_loopback_tcp_gbps(256 << 20)
    measure_transport_gbps("torch_distributed", 1, 2, 256 << 20, 32 << 20)

Every sender and receiver is its own process (multiprocessing "spawn"), so the numbers include
the copies between processes that a real transfer makes. Times start after every side is set up
(a barrier) and end when the last receiver holds the last bucket; GB/s are 1e9 bytes per second
of what each receiver gets.

Mooncake listens on every interface: measure it inside a private network namespace, e.g.
    unshare -n -- sh -c 'ip link set lo up && python -m relayrl.weightsync.transports.measure'
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import socket
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

_CHUNK_BYTES = 4 << 20
_WAIT_S = 600.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _tcp_receiver(num_bytes: int, out: Connection) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        out.send(listener.getsockname()[1])
        connection, _ = listener.accept()
    with connection:
        buffer = memoryview(bytearray(_CHUNK_BYTES))
        received = 0
        while received < num_bytes:
            count = connection.recv_into(buffer, min(_CHUNK_BYTES, num_bytes - received))
            if count == 0:
                raise ConnectionError("the sender closed early")
            received += count
        connection.sendall(b"k")


def measure_loopback_tcp_gbps(num_bytes: int) -> float:
    """GB/s of one plain TCP stream over loopback between two processes: the ceiling any
    TCP-based transport can reach here."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    receiver = context.Process(target=_tcp_receiver, args=(num_bytes, writer), daemon=True)
    receiver.start()
    try:
        port = reader.recv()
        payload = memoryview(bytes(_CHUNK_BYTES))
        with socket.create_connection(("127.0.0.1", port)) as connection:
            started = time.perf_counter()
            sent = 0
            while sent < num_bytes:
                count = min(_CHUNK_BYTES, num_bytes - sent)
                connection.sendall(payload[:count])
                sent += count
            if connection.recv(1) != b"k":
                raise ConnectionError("the receiver did not confirm")
            elapsed_s = time.perf_counter() - started
        receiver.join(_WAIT_S)
    finally:
        if receiver.is_alive():
            receiver.kill()
    return num_bytes / elapsed_s / 1e9


def _transport_role(
    spec_json: str, role: str, rank: int, barrier: Barrier, out: Connection
) -> None:
    import torch

    from relayrl.weightsync.transports.base import TransportSpec, open_sink, open_source

    spec = TransportSpec.from_json(spec_json)
    model = None
    if role == "sender":  # every sender holds the whole exported model
        model = torch.empty(spec.total_bytes, dtype=torch.uint8).random_()
    rss_before_open_bytes = _rss_bytes()
    if role == "sender":
        sink = open_sink(spec, rank)
        offsets = [0]
        for size in spec.bucket_sizes:
            offsets.append(offsets[-1] + size)
        barrier.wait(_WAIT_S)
        started = time.time()
        assert model is not None
        with sink:
            for index in spec.buckets_of(rank):
                sink.send(index, model[offsets[index] : offsets[index + 1]])
    else:
        source = open_source(spec, rank)
        barrier.wait(_WAIT_S)
        started = time.time()
        with source:
            for index in range(spec.num_buckets):
                source.recv(index)[-1].item()  # touch it, as a loader would
            received = time.time()  # closing is not part of moving the bytes
    out.send(
        {
            "role": role,
            "started": started,
            "ended": received if role == "receiver" else time.time(),
            "peak_extra_bytes": _peak_rss_bytes() - rss_before_open_bytes,
        }
    )


def measure_transport_gbps(
    type: str, num_senders: int, num_receivers: int, total_bytes: int, bucket_bytes: int
) -> dict[str, Any]:
    """One transfer of `total_bytes` in buckets of `bucket_bytes` (the last one shorter) from
    `num_senders` to `num_receivers` processes over transport `type`.

    Returns gbps (per receiver), aggregate_gbps (all receivers together), elapsed_s,
    num_buckets and peak_extra_bytes: the most a receiver's peak RSS grew past its RSS before
    the transfer was set up (the two receive buffers plus the transport's own)."""
    from relayrl.weightsync.transports.base import TransportSpec

    if type == "mooncake" and set(os.listdir("/sys/class/net")) - {"lo"}:
        warnings.warn(
            "Mooncake listens on every interface: measure it inside `unshare -n`",
            stacklevel=2,
        )
    sizes = [bucket_bytes] * (total_bytes // bucket_bytes)
    if total_bytes % bucket_bytes:
        sizes.append(total_bytes % bucket_bytes)
    spec = TransportSpec(
        type=type,
        transfer_id=f"measure-{os.getpid()}-{time.monotonic_ns()}",
        num_senders=num_senders,
        num_receivers=num_receivers,
        bucket_sizes=sizes,
        rendezvous=f"127.0.0.1:{_free_port()}",
        timeout_s=120.0,
    )
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_senders + num_receivers)
    roles = [("sender", s) for s in range(num_senders)]
    roles += [("receiver", r) for r in range(num_receivers)]
    processes, readers = [], []
    for role, rank in roles:
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_transport_role,
            args=(spec.to_json(), role, rank, barrier, writer),
            daemon=True,
        )
        process.start()
        writer.close()
        processes.append(process)
        readers.append(reader)
    try:
        reports = []
        for (role, rank), reader in zip(roles, readers, strict=True):
            if not reader.poll(_WAIT_S):
                raise TimeoutError(f"{role} {rank} did not report within {_WAIT_S:g} s")
            try:
                reports.append(reader.recv())
            except EOFError:
                raise RuntimeError(f"{role} {rank} failed (exit code on stderr)") from None
        for process in processes:
            process.join(_WAIT_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    started = min(r["started"] for r in reports)
    elapsed_s = max(r["ended"] for r in reports if r["role"] == "receiver") - started
    gbps = total_bytes / elapsed_s / 1e9
    return {
        "type": type,
        "num_senders": num_senders,
        "num_receivers": num_receivers,
        "total_bytes": total_bytes,
        "bucket_bytes": bucket_bytes,
        "num_buckets": len(sizes),
        "gbps": gbps,
        "aggregate_gbps": gbps * num_receivers,
        "elapsed_s": elapsed_s,
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in reports if r["role"] == "receiver"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=256 << 20, help="bytes per transfer")
    parser.add_argument("--bucket-bytes", type=int, default=32 << 20, help="bytes per bucket")
    parser.add_argument(
        "--transports", nargs="+", default=["torch_distributed", "mooncake"], help="to measure"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["1x1", "1x2", "2x2"], help="SENDERSxRECEIVERS"
    )
    args = parser.parse_args()
    print(json.dumps({"loopback_tcp_gbps": measure_loopback_tcp_gbps(args.bytes)}), flush=True)
    for transport in args.transports:
        for shape in args.shapes:
            num_senders, num_receivers = (int(n) for n in shape.split("x"))
            result = measure_transport_gbps(
                transport, num_senders, num_receivers, args.bytes, args.bucket_bytes
            )
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
