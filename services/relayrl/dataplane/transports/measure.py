"""Throughput of the data-plane transports on this machine, for a bench script to print side by
side with the physical limit (loopback TCP between two processes) and with plain TCP fan-out
(one or more sender processes writing the same bytes to each receiver process: the ceiling of
any broadcast over TCP here).

    measure_loopback_tcp_gbps(256 << 20)
    measure_tcp_gbps(256 << 20, num_senders=1, num_receivers=2)
    measure_transport_gbps("torch_distributed", 1, 2, 256 << 20, 32 << 20)

Every sender and receiver is its own process (multiprocessing "spawn"), so the numbers include
the copies between processes that a real transfer makes. Times start after every side is set up
(a barrier) and end when the last receiver holds the last bucket; GB/s are 1e9 bytes per second
of what each receiver gets.

Mooncake listens on every interface: measure it inside a private network namespace, e.g.
    unshare -n -- sh -c 'ip link set lo up && python -m relayrl.dataplane.transports.measure'
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import resource
import socket
import threading
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

from relayrl.core.dotted import import_object
from relayrl.core.ports import free_port

_CHUNK_BYTES = 4 << 20
_WAIT_S = 600.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRssWindow:
    """How far this process's RSS rose above its RSS at construction (the baseline).

    The kernel's high-water mark is reset at construction (Linux >= 4.0: `/proc/self/clear_refs`
    "5"), so a peak from before the window (imports, set-up, a spawned child's inherited mark)
    is not counted; where it cannot be reset, `ru_maxrss` (the lifetime peak) stands in. Start
    it after the imports a warm process already has: those are paid once per process, not per
    transfer."""

    def __init__(self) -> None:
        self.baseline_bytes = _rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak_bytes(self) -> int:
        if self.resettable:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def peak_extra_bytes(self) -> int:
        return self.peak_bytes() - self.baseline_bytes


def _touched_buffer(num_bytes: int) -> memoryview:
    """`num_bytes` of memory with every page already faulted in (a zeroed allocation maps the
    shared zero page, which would make reading it unrealistically cheap)."""
    return memoryview(bytearray(b"\xa5") * num_bytes)


def _recv_exactly(
    connection: socket.socket, num_bytes: int, chunk_bytes: int, buffer: memoryview
) -> None:
    """Receive `num_bytes` into `buffer`, chunk by chunk, wrapping around at its end."""
    received = offset = 0
    while received < num_bytes:
        if offset + chunk_bytes > len(buffer):
            offset = 0
        count = connection.recv_into(buffer[offset:], min(chunk_bytes, num_bytes - received))
        if count == 0:
            raise ConnectionError("a sender closed early")
        received += count
        offset += count


def _send_exactly(
    connection: socket.socket, num_bytes: int, chunk_bytes: int, payload: memoryview
) -> None:
    """Send `num_bytes` out of `payload`, chunk by chunk, wrapping around at its end."""
    sent = offset = 0
    while sent < num_bytes:
        if offset + chunk_bytes > len(payload):
            offset = 0
        count = min(chunk_bytes, num_bytes - sent)
        connection.sendall(payload[offset : offset + count])
        sent += count
        offset += count


def _on_threads(work: list[Callable[[], None]]) -> None:
    """Run every callable at once, one thread each (the socket calls release the GIL); the
    first failure is raised."""
    if len(work) == 1:
        work[0]()
        return
    failures: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # re-raised in the caller below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def _share_bytes(num_bytes: int, num_senders: int, sender: int) -> int:
    return num_bytes // num_senders + (sender < num_bytes % num_senders)


class _CpuClocks:
    """CPU time of one side of a transfer: this process's user + system time, and the machine's
    softirq time (where loopback TCP does its receive processing; kernels with IRQ time
    accounting charge it to no process) as counter readings, which `_total_cpu_s` turns into
    one span over every side."""

    def __init__(self) -> None:
        self._process_s = self._process_now_s()
        self._softirq_start_s = self._softirq_now_s()

    @staticmethod
    def _process_now_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    @staticmethod
    def _softirq_now_s() -> float:
        with open("/proc/stat") as stat:
            return int(stat.readline().split()[7]) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> dict[str, float]:
        return {
            "process_cpu_s": self._process_now_s() - self._process_s,
            "softirq_start_s": self._softirq_start_s,
            "softirq_end_s": self._softirq_now_s(),
        }


def _total_cpu_s(sides: list[dict[str, Any]]) -> float:
    """Every side's own CPU time plus the machine's softirq time from the first side's start
    to the last side's end (other load adds a little of its own there)."""
    softirq_s = max(s["softirq_end_s"] for s in sides) - min(s["softirq_start_s"] for s in sides)
    return sum(s["process_cpu_s"] for s in sides) + softirq_s


def _tcp_receiver(
    num_bytes: int, num_senders: int, chunk_bytes: int, buffer_bytes: int, out: Connection
) -> None:
    buffers = [
        _touched_buffer(max(chunk_bytes, buffer_bytes // num_senders)) for _ in range(num_senders)
    ]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        out.send(listener.getsockname()[1])
        accepted = [listener.accept()[0] for _ in range(num_senders)]
    # A sender says who it is first, so each connection knows its share.
    senders = {int.from_bytes(c.recv(1, socket.MSG_WAITALL), "big"): c for c in accepted}
    try:
        clocks = _CpuClocks()  # waiting for the first byte costs no CPU
        _on_threads(
            [
                functools.partial(
                    _recv_exactly,
                    c,
                    _share_bytes(num_bytes, num_senders, s),
                    chunk_bytes,
                    buffers[s],
                )
                for s, c in senders.items()
            ]
        )
        ended, cpu = time.time(), clocks.stop()
        for connection in accepted:
            connection.sendall(b"k")
    finally:
        for connection in accepted:
            connection.close()
    out.send({"ended": ended, **cpu})


def _tcp_sender(
    num_bytes: int,
    num_senders: int,
    sender: int,
    ports: list[int],
    chunk_bytes: int,
    buffer_bytes: int,
    barrier: Barrier,
    out: Connection,
) -> None:
    share = _share_bytes(num_bytes, num_senders, sender)
    payload = _touched_buffer(max(chunk_bytes, min(buffer_bytes, share)))
    connections = [socket.create_connection(("127.0.0.1", port)) for port in ports]
    try:
        for connection in connections:
            connection.sendall(sender.to_bytes(1, "big"))
        barrier.wait(_WAIT_S)
        started, clocks = time.time(), _CpuClocks()
        _on_threads(
            [functools.partial(_send_exactly, c, share, chunk_bytes, payload) for c in connections]
        )
        for connection in connections:
            if connection.recv(1) != b"k":
                raise ConnectionError("a receiver did not confirm")
        cpu = clocks.stop()
    finally:
        for connection in connections:
            connection.close()
    out.send({"started": started, **cpu})


def measure_tcp(
    num_bytes: int,
    num_senders: int = 1,
    num_receivers: int = 1,
    chunk_bytes: int = _CHUNK_BYTES,
    *,
    send_buffer_bytes: int = 0,
    recv_buffer_bytes: int = 0,
) -> dict[str, float]:
    """Plain TCP over loopback: `num_senders` processes each write their share of `num_bytes` to
    each of `num_receivers` processes (one connection and one thread per pair, `sendall` /
    `recv_into` of `chunk_bytes`), so every receiver gets `num_bytes`. With one receiver it is
    the ceiling of any TCP-based transport; with more it is the ceiling of any broadcast over
    TCP here (the same bytes written once per receiver, as gloo and Mooncake do). Clock: from
    the senders' start (a barrier) to the last receiver holding its last byte.

    By default a sender sends one `chunk_bytes` buffer over and over and a receiver receives
    into one, which stay in the CPU caches: the most TCP can do. A transfer reads a model from
    memory and writes buckets there: `send_buffer_bytes` (a sender cycles through that much, at
    most its share) and `recv_buffer_bytes` (a receiver cycles through that much, split between
    its senders) make the baseline do the same.

    Returns gbps (per receiver) and cpu_s_per_gb: CPU seconds (every process's user + system
    time, plus the machine's softirq time meanwhile) per 1e9 bytes delivered to a receiver, to
    set a transport's CPU cost beside plain TCP's (other load moves it far less than gbps)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_senders)
    processes, readers = [], []

    def start(target: Callable[..., None], *args: Any) -> Connection:
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=target, args=(*args, writer), daemon=True)
        process.start()
        writer.close()
        processes.append(process)
        readers.append(reader)
        return reader

    try:
        receivers = [
            start(_tcp_receiver, num_bytes, num_senders, chunk_bytes, recv_buffer_bytes)
            for _ in range(num_receivers)
        ]
        ports = [_report(reader, "TCP receiver") for reader in receivers]
        senders = [
            start(
                _tcp_sender,
                num_bytes,
                num_senders,
                s,
                ports,
                chunk_bytes,
                send_buffer_bytes,
                barrier,
            )
            for s in range(num_senders)
        ]
        ends = [_report(reader, "TCP receiver") for reader in receivers]
        starts = [_report(reader, "TCP sender") for reader in senders]
        for process in processes:
            process.join(_WAIT_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    elapsed_s = max(r["ended"] for r in ends) - min(r["started"] for r in starts)
    return {
        "gbps": num_bytes / elapsed_s / 1e9,
        "cpu_s_per_gb": _total_cpu_s(ends + starts) / (num_bytes * num_receivers / 1e9),
    }


def measure_tcp_gbps(
    num_bytes: int, num_senders: int = 1, num_receivers: int = 1, chunk_bytes: int = _CHUNK_BYTES
) -> float:
    """GB/s per receiver of `measure_tcp`."""
    return measure_tcp(num_bytes, num_senders, num_receivers, chunk_bytes)["gbps"]


def measure_loopback_tcp_gbps(num_bytes: int) -> float:
    """GB/s of one plain TCP stream over loopback between two processes: the ceiling any
    TCP-based transport can reach here."""
    return measure_tcp_gbps(num_bytes, 1, 1)


def _report(reader: Connection, who: str) -> Any:
    if not reader.poll(_WAIT_S):
        raise TimeoutError(f"a {who} did not report within {_WAIT_S:g} s")
    try:
        return reader.recv()
    except EOFError:
        raise RuntimeError(f"a {who} failed (its traceback is on stderr)") from None


def _transport_role(
    spec_json: str, role: str, rank: int, barrier: Barrier, out: Connection
) -> None:
    import torch

    from relayrl.dataplane.transports.base import (
        TRANSPORTS,
        TransportSpec,
        open_sink,
        open_source,
    )

    spec = TransportSpec.from_json(spec_json)
    device = torch.device("cpu")
    if spec.device == "cuda":  # one GPU per process, as NCCL requires
        index = rank if role == "sender" else spec.num_senders + rank
        torch.cuda.set_device(index % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    model = None
    if role == "sender":  # every sender holds the whole exported model
        model = torch.empty(spec.total_bytes, dtype=torch.uint8, device=device).random_()
    # The backend's modules first: an engine imports them once, not once per transfer.
    import_object(TRANSPORTS[spec.type][role == "receiver"], what=f"{spec.type} transport")
    window = PeakRssWindow()
    if role == "sender":
        sink = open_sink(spec, rank)
        offsets = [0]
        for size in spec.bucket_sizes:
            offsets.append(offsets[-1] + size)
        set_up_bytes = _rss_bytes() - window.baseline_bytes
        barrier.wait(_WAIT_S)
        started, clocks = time.time(), _CpuClocks()
        assert model is not None
        with sink:
            for index in spec.buckets_of(rank):
                sink.send(index, model[offsets[index] : offsets[index + 1]])
    else:
        source = open_source(spec, rank)
        set_up_bytes = _rss_bytes() - window.baseline_bytes
        barrier.wait(_WAIT_S)
        started, clocks = time.time(), _CpuClocks()
        with source:
            for index in range(spec.num_buckets):
                source.recv(index)[-1].item()  # touch it, as a loader would
            received = time.time()  # closing is not part of moving the bytes
    out.send(
        {
            "role": role,
            "started": started,
            "ended": received if role == "receiver" else time.time(),
            **clocks.stop(),
            "set_up_extra_bytes": set_up_bytes,
            "peak_extra_bytes": window.peak_extra_bytes(),
        }
    )


def measure_transport_gbps(
    type: str,
    num_senders: int,
    num_receivers: int,
    total_bytes: int,
    bucket_bytes: int,
    *,
    device: str = "cpu",
) -> dict[str, Any]:
    """One transfer of `total_bytes` in buckets of `bucket_bytes` (the last one shorter) from
    `num_senders` to `num_receivers` processes over transport `type` (`device` cuda: each
    process on its own GPU, the buckets in GPU memory).

    Returns gbps (per receiver), aggregate_gbps (all receivers together), elapsed_s,
    num_buckets, peak_extra_bytes: the most a receiver's peak RSS rose above its RSS before the
    transfer was set up, with the backend's modules already imported (the two receive buffers
    plus the transport's own: connections, threads), and set_up_extra_bytes: how much of that
    was there once set up, before the first bucket, and cpu_s_per_gb as `measure_tcp` has it."""
    from relayrl.dataplane.transports.base import TransportSpec

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
        rendezvous=f"127.0.0.1:{free_port()}",
        timeout_s=120.0,
        device=device,
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
    receivers = [r for r in reports if r["role"] == "receiver"]
    elapsed_s = max(r["ended"] for r in receivers) - started
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
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in receivers),
        "set_up_extra_bytes": max(r["set_up_extra_bytes"] for r in receivers),
        "cpu_s_per_gb": _total_cpu_s(reports) / (total_bytes * num_receivers / 1e9),
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
    tcp = {"loopback_tcp_gbps": measure_loopback_tcp_gbps(args.bytes)}
    for shape in args.shapes:
        num_senders, num_receivers = (int(n) for n in shape.split("x"))
        if num_receivers > 1:
            tcp[f"fanout_tcp_gbps_{shape}"] = measure_tcp_gbps(
                args.bytes, num_senders, num_receivers
            )
    print(json.dumps(tcp), flush=True)
    for transport in args.transports:
        for shape in args.shapes:
            num_senders, num_receivers = (int(n) for n in shape.split("x"))
            result = measure_transport_gbps(
                transport, num_senders, num_receivers, args.bytes, args.bucket_bytes
            )
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
