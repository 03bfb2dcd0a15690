"""Moving a version: a synthetic model of about `--gib` GiB of bf16 tensors with Qwen2-like
shapes, from 1-2 sender processes to 2 receiver processes, over each data plane, next to the
physical limit here (loopback TCP between two processes) and next to plain TCP fan-out (the
same bytes written to each of the 2 receivers, the most any broadcast over TCP can do here), in
one run.

    grpc               senders export, pack (double-buffered) and push their share of the
                       buckets to a real relayrl-weightsync process; both receivers pull the
                       buckets and cut them back into tensors (receive_tensors, the
                       engine-side code) at the same time, cut through: from the moment the
                       version is planned, each bucket as soon as the service has it. Clock:
                       from the first export to the last tensor at the last receiver.
    shm                the same, but the service keeps the buckets in shared memory: senders
                       write them into its files and receivers read them from there
                       (docs/weightsync.md#shared-memory; every process here shares the host)
    grpc store+fwd     the same, but the receivers start once the version is committed (as
                       with data_plane.cut_through false)
    torch_distributed  raw buckets broadcast over a gloo group (transports.measure)
    mooncake           raw buckets written by the Mooncake transfer engine over TCP, measured
                       inside a private network namespace (it listens on every interface)

GB/s are bytes each receiver gets per second. `ratio` divides them by the physical limit (one
TCP stream), `fan-out` by plain TCP from as many sender processes writing the same bytes to the
same 2 receivers out of one cache-resident chunk, `fan-mem` by the same fan-out reading a
model-sized buffer and writing into two buckets' worth, as a transfer does. The TCP baselines
run first, each `--tcp-repeats` times interleaved; the table divides by the best run of each (a
limit is the most the link showed: on a shared machine a single loopback stream scatters 2x
with scheduling, and a median would flatter the transports). CPU-s/GB: CPU seconds of every
process plus the machine's softirq time per GB a receiver gets, to compare a transport's CPU
cost with plain TCP's in the same run (on 2 cores a broadcast is CPU-bound). `extra` is the
most a receiver's peak RSS rose above its RSS just before the transfer, with the modules it
needs already imported (an engine imports them once, not per version), in buckets (the target:
at most 2 beyond the model itself; these receivers drop each tensor once assembled, as the
engine's load path consumes it). fp8_bytes compares the FP8 block-128 export (with scales,
embeddings in bf16 as by default) to the bf16 one for the same model; the line above it also
gives it with quantize_embeddings.

The last line is exactly:
    weightsync-bench: best=<transport> ratio=<best GB/s / loopback TCP GB/s> fp8_bytes=<ratio>
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, KV, FFN, VOCAB = 1024, 128, 2816, 32768
# (senders, receivers, from memory): 1x1 is the physical limit; the others write the
# same bytes to each of 2 receivers. From memory: a sender reads its share of a model-sized
# buffer and a receiver writes into two buckets' worth, as a transfer does, instead of one
# cache-resident chunk.
TCP_BASELINES = ((1, 1, False), (1, 2, False), (2, 2, False), (1, 2, True), (2, 2, True))


def synthetic_model(gib: float, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Qwen2-shaped bf16 tensors summing to about `gib` GiB (deterministic for a seed)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    per_layer = [
        ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
        ("self_attn.q_proj.bias", (HIDDEN,)),
        ("self_attn.k_proj.weight", (KV, HIDDEN)),
        ("self_attn.k_proj.bias", (KV,)),
        ("self_attn.v_proj.weight", (KV, HIDDEN)),
        ("self_attn.v_proj.bias", (KV,)),
        ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
        ("mlp.gate_proj.weight", (FFN, HIDDEN)),
        ("mlp.up_proj.weight", (FFN, HIDDEN)),
        ("mlp.down_proj.weight", (HIDDEN, FFN)),
        ("input_layernorm.weight", (HIDDEN,)),
        ("post_attention_layernorm.weight", (HIDDEN,)),
    ]
    layer_bytes = 2 * sum(torch.Size(s).numel() for _, s in per_layer)
    num_layers = max(1, round((gib * 2**30 - 2 * VOCAB * HIDDEN) / layer_bytes))
    for i in range(num_layers):
        shapes += [(f"model.layers.{i}.{name}", shape) for name, shape in per_layer]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    return [
        (name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
        for name, shape in shapes
    ]


def _grpc_sender(target: str, rank: int, world: int, gib: float, out: Any, go: Any) -> None:
    from relayrl.weightsync.sender import WeightSyncSender

    tensors = synthetic_model(gib)  # "the trainer's model", before the clock starts
    sender = WeightSyncSender(target, rank=rank, world_size=world, timeout_s=600)
    go.wait()
    start = time.perf_counter()
    result = sender.publish(1, 1, tensors)
    out.send({"transfer_id": result.transfer_id, "push_s": time.perf_counter() - start,
              "bytes_total": result.bytes_total})  # fmt: skip
    sender.close()


def _grpc_receiver(target: str, transport: str, inbox: Any, out: Any) -> None:
    import grpc  # noqa: F401 - imported once per engine process, not per version

    from relayrl.core import grpc_client  # noqa: F401
    from relayrl.dataplane import quant  # noqa: F401
    from relayrl.dataplane.receiver import receive_tensors
    from relayrl.dataplane.transports.measure import PeakRssWindow
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc  # noqa: F401

    transfer_id, digest = inbox.recv()  # started early: imports are not on the clock
    window = PeakRssWindow()
    start = time.perf_counter()
    stats: dict[str, Any] = {}
    num_bytes = 0
    for _, tensor in receive_tensors(
        {
            "target": target,
            "transfer_id": transfer_id,
            "plan_digest": digest,
            "timeout_s": 600,
            "transport": transport,
        },
        stats,
    ):
        num_bytes += tensor.numel() * tensor.element_size()
    out.send({"pull_s": time.perf_counter() - start, "bytes": stats["bytes"],
              "extra_bytes": window.peak_extra_bytes()})  # fmt: skip


def bench_grpc(
    gib: float,
    num_senders: int,
    bucket_bytes: int,
    work: Path,
    *,
    cut_through: bool = True,
    transport: str = "grpc",
) -> dict[str, Any]:
    import grpc

    from relayrl.core.service_process import ServiceProcess
    from relayrl.dataplane.plan import layouts_from_plan, plan_digest
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

    ctx = multiprocessing.get_context("spawn")
    config = {
        "bucket_size_bytes": bucket_bytes,
        "chunk_size_bytes": 4 << 20,
        "grpc": {"max_message_bytes": 64 << 20},
        "transfer_timeout_s": 600,
        "data_plane": {"cut_through": cut_through, "transport": transport},
    }
    name = f"ws-{transport}-{num_senders}-{'cut' if cut_through else 'saf'}"
    with ServiceProcess("relayrl-weightsync", config, work / name) as service:
        receivers = []
        for _ in range(2):
            inbox, inbox_child = ctx.Pipe()
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_grpc_receiver, args=(service.target, transport, inbox_child, child)
            )
            p.start()
            receivers.append((inbox, parent, p))
        go = ctx.Barrier(num_senders + 1)
        pipes, procs = [], []
        for rank in range(num_senders):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_grpc_sender, args=(service.target, rank, num_senders, gib, child, go)
            )
            p.start()
            pipes.append(parent)
            procs.append(p)
        go.wait()
        start = time.perf_counter()
        sent: list[dict[str, Any]] = []
        with grpc.insecure_channel(service.target) as channel:
            stub = weightsync_pb2_grpc.WeightSyncStub(channel)
            # Cut through, the receivers start as soon as the version is planned (the switch
            # starts the engines' pull at its first bucket); store and forward, once the
            # version is committed.
            transfer_id = digest = ""
            while not transfer_id:
                reply = stub.GetVersion(pb.GetVersionRequest(), timeout=10)
                if cut_through and reply.in_progress.transfer_id:
                    plan = reply.in_progress
                    transfer_id, digest = plan.transfer_id, plan_digest(layouts_from_plan(plan))
                elif reply.committed.version == 1:
                    sent = [pipe.recv() for pipe in pipes]
                    transfer_id, digest = sent[0]["transfer_id"], reply.committed.checksum
                else:
                    time.sleep(0.005)
        for inbox, _, _ in receivers:
            inbox.send((transfer_id, digest))
        if len(sent) < num_senders:
            sent = [pipe.recv() for pipe in pipes]
        received = [parent.recv() for _, parent, _ in receivers]
        for _, _, p in receivers:
            p.join()
        for p in procs:
            p.join()
        elapsed = time.perf_counter() - start
    total = sent[0]["bytes_total"]
    return {
        "gbps": total / elapsed / 1e9,
        "extra_buckets": max(r["extra_bytes"] for r in received) / bucket_bytes,
        "detail": f"push {max(s['push_s'] for s in sent):.2f}s, "
        f"pull {max(r['pull_s'] for r in received):.2f}s",
    }


def bench_raw(kind: str, num_senders: int, total: int, bucket_bytes: int) -> dict[str, Any]:
    from relayrl.dataplane.transports.measure import measure_transport_gbps

    return _raw_row(measure_transport_gbps(kind, num_senders, 2, total, bucket_bytes))


def _raw_row(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "gbps": r["gbps"],
        "extra_buckets": r["peak_extra_bytes"] / r["bucket_bytes"],
        "cpu_s_per_gb": r["cpu_s_per_gb"],
        "detail": "",
    }


def bench_mooncake(num_senders: int, total: int, bucket_bytes: int) -> dict[str, Any] | str:
    """Inside a private network namespace (Mooncake binds every interface)."""
    if shutil.which("unshare") is None:
        return "unshare not available"
    code = (
        "import json\n"
        "from relayrl.dataplane.transports.measure import measure_transport_gbps\n"
        f"print(json.dumps(measure_transport_gbps('mooncake', {num_senders}, 2, {total}, "
        f"{bucket_bytes})))\n"
    )
    done = subprocess.run(
        ["unshare", "-n", "--", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"',
         sys.executable, code],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["failed"])[-1][:120]
    return _raw_row(json.loads(done.stdout.strip().splitlines()[-1]))


def fp8_ratios(gib: float) -> tuple[float, float]:
    """FP8 block-128 bytes (with scales) over bf16 bytes: the default export (embeddings in
    bf16), and with `quantize_embeddings`."""
    from relayrl.weightsync.sender import export_tensors

    tensors = synthetic_model(gib)

    def size(d: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in d.values())

    bf16 = size(export_tensors(tensors, "none")[0])
    fp8 = size(export_tensors(tensors, "fp8_block_128")[0])
    fp8_all = size(export_tensors(tensors, "fp8_block_128", quantize_embeddings=True)[0])
    return fp8 / bf16, fp8_all / bf16


def tcp_baselines(
    total: int, bucket_bytes: int, repeats: int
) -> dict[tuple[int, int, bool], list[dict[str, float]]]:
    """`measure_tcp` of every TCP_BASELINES entry, `repeats` times, interleaved so that drift
    in the machine's other load hits every baseline alike."""
    from relayrl.dataplane.transports.measure import measure_tcp

    runs: dict[tuple[int, int, bool], list[dict[str, float]]] = {b: [] for b in TCP_BASELINES}
    for _ in range(repeats):
        for senders, receivers, from_memory in TCP_BASELINES:
            buffers = {"send_buffer_bytes": total, "recv_buffer_bytes": 2 * bucket_bytes}
            runs[senders, receivers, from_memory].append(
                measure_tcp(total, senders, receivers, **(buffers if from_memory else {}))
            )
    return runs


def print_baselines(runs: dict[tuple[int, int, bool], list[dict[str, float]]]) -> None:
    limit = max(r["gbps"] for r in runs[1, 1, False])
    print(
        f"loopback TCP, GB/s per receiver (best of {len(runs[1, 1, False])} [min-median]) and "
        "CPU seconds per GB delivered (all processes + softirq):"
    )
    for (senders, receivers, from_memory), results in runs.items():
        gbps = [r["gbps"] for r in results]
        what = "the physical limit: `ratio`" if receivers == 1 else "fan-out: `fan-out`"
        if from_memory:
            what = "fan-out, model and buckets in memory: `fan-mem`"
        print(
            f"  {senders} -> {receivers}  {max(gbps):5.2f} "
            f"[{min(gbps):.2f}-{statistics.median(gbps):.2f}]  "
            f"{statistics.median(r['cpu_s_per_gb'] for r in results):.2f} CPU-s/GB  {what}"
        )
    best = max(r["gbps"] for k, v in runs.items() if k[1] == 2 for r in v)
    print(f"  the most `ratio` a TCP broadcast to 2 receivers reached here: {best / limit:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model size in GiB (bf16)")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--tcp-repeats", type=int, default=3, help="runs of each TCP baseline")
    args = parser.parse_args()

    bucket = args.bucket_mib << 20
    total = int(args.gib * 2**30)
    runs = tcp_baselines(total, bucket, args.tcp_repeats)
    rows: list[tuple[str, int, Any]] = []
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        rows.append(
            ("grpc store+fwd", 1, bench_grpc(args.gib, 1, bucket, Path(tmp), cut_through=False))
        )
        for senders in (1, 2):
            rows.append(("grpc", senders, bench_grpc(args.gib, senders, bucket, Path(tmp))))
            shm = bench_grpc(args.gib, senders, bucket, Path(tmp), transport="shm")
            rows.append(("shm", senders, shm))
            try:
                rows.append(
                    (
                        "torch_distributed",
                        senders,
                        bench_raw("torch_distributed", senders, total, bucket),
                    )
                )
            except Exception as exc:  # reported in the table
                rows.append(("torch_distributed", senders, str(exc)[:120]))
            rows.append(("mooncake", senders, bench_mooncake(senders, total, bucket)))
    print_baselines(runs)
    limits = {key: max(r["gbps"] for r in results) for key, results in runs.items()}
    limit = limits[1, 1, False]
    columns = ("GB/s", "ratio", "fan-out", "fan-mem", "CPU-s/GB", "extra")
    print(f"{'transport':<18}{'senders':>8}" + "".join(f"{c:>9}" for c in columns) + "  detail")
    best = ("none", 0.0)
    for name, senders, r in rows:
        if isinstance(r, str):
            print(f"{name:<18}{senders:>8}" + f"{'-':>9}" * len(columns) + f"  {r}")
            continue
        values = (
            r["gbps"],
            r["gbps"] / limit,
            r["gbps"] / limits[senders, 2, False],
            r["gbps"] / limits[senders, 2, True],
            r.get("cpu_s_per_gb"),  # not for grpc: its service is a process of its own
            r["extra_buckets"],
        )
        cells = "".join(f"{'-':>9}" if v is None else f"{v:>9.2f}" for v in values)
        print(f"{name:<18}{senders:>8}{cells}  {r['detail']}".rstrip())
        if r["gbps"] > best[1] and name != "grpc store+fwd":
            best = (name, r["gbps"])
    grpc_best = max(r["gbps"] for name, _, r in rows if name == "grpc" and isinstance(r, dict))
    saf = next(r["gbps"] for name, _, r in rows if name == "grpc store+fwd")
    print(f"grpc data plane, cut-through: ratio={grpc_best / limit:.2f} (target 0.5; store and "
          f"forward {saf / limit:.2f})")  # fmt: skip
    fp8, fp8_all = fp8_ratios(args.gib)
    print(f"fp8 bytes / bf16 bytes: {fp8:.3f} (embeddings in bf16, the default), "
          f"{fp8_all:.3f} (quantize_embeddings)")  # fmt: skip
    print(f"weightsync-bench: best={best[0]} ratio={best[1] / limit:.2f} fp8_bytes={fp8:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
