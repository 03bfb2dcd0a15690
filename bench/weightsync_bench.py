"""Moving a version: a synthetic model of about `--gib` GiB of bf16 tensors with Qwen2-like
shapes, from 1-2 sender processes to 2 receiver processes, over each data plane, next to the
physical limit here (loopback TCP between two processes), in one run.

    grpc               senders export, pack (double-buffered) and push their share of the
                       buckets to a real relayrl-weightsync process; once the version is
                       complete both receivers pull it and cut it back into tensors
                       (receive_tensors, the engine-side code) at the same time. Clock: from
                       the first export to the last tensor at the last receiver.
    torch_distributed  raw buckets broadcast over a gloo group (transports.measure)
    mooncake           raw buckets written by the Mooncake transfer engine over TCP, measured
                       inside a private network namespace (it listens on every interface)

GB/s are bytes each receiver gets per second. `extra` is the most a receiver's peak RSS grew
while receiving, in buckets (the target: at most 2 beyond the model itself; these receivers
drop each tensor once assembled, as the engine's load path consumes it). fp8_bytes compares
the FP8 block-128 export (with scales) to the bf16 one for the same model.

The last line is exactly:
    weightsync-bench: best=<transport> ratio=<best GB/s / loopback TCP GB/s> fp8_bytes=<ratio>
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, KV, FFN, VOCAB = 1024, 128, 2816, 32768


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


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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


def _grpc_receiver(target: str, inbox: Any, out: Any) -> None:
    from relayrl.weightsync.receiver import receive_tensors

    transfer_id, digest = inbox.recv()  # started early: imports are not on the clock
    before = _rss_bytes()
    start = time.perf_counter()
    stats: dict[str, Any] = {}
    num_bytes = 0
    for _, tensor in receive_tensors(
        {"target": target, "transfer_id": transfer_id, "plan_digest": digest, "timeout_s": 600},
        stats,
    ):
        num_bytes += tensor.numel() * tensor.element_size()
    out.send({"pull_s": time.perf_counter() - start, "bytes": stats["bytes"],
              "extra_bytes": _peak_rss_bytes() - before})  # fmt: skip


def bench_grpc(gib: float, num_senders: int, bucket_bytes: int, work: Path) -> dict[str, Any]:
    import grpc

    from relayrl.core.service_process import ServiceProcess
    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

    ctx = multiprocessing.get_context("spawn")
    config = {
        "bucket_size_bytes": bucket_bytes,
        "chunk_size_bytes": 4 << 20,
        "grpc": {"max_message_bytes": 64 << 20},
        "transfer_timeout_s": 600,
    }
    with ServiceProcess("relayrl-weightsync", config, work / f"ws-{num_senders}") as service:
        receivers = []
        for _ in range(2):
            inbox, inbox_child = ctx.Pipe()
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_grpc_receiver, args=(service.target, inbox_child, child))
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
        sent = [pipe.recv() for pipe in pipes]
        for p in procs:
            p.join()
        with grpc.insecure_channel(service.target) as channel:
            stub = weightsync_pb2_grpc.WeightSyncStub(channel)
            while stub.GetVersion(pb.GetVersionRequest(), timeout=10).committed.version != 1:
                time.sleep(0.01)
            digest = stub.GetVersion(pb.GetVersionRequest(), timeout=10).committed.checksum
        for inbox, _, _ in receivers:
            inbox.send((sent[0]["transfer_id"], digest))
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
    from relayrl.weightsync.transports.measure import measure_transport_gbps

    r = measure_transport_gbps(kind, num_senders, 2, total, bucket_bytes)
    return {"gbps": r["gbps"], "extra_buckets": r["peak_extra_bytes"] / bucket_bytes, "detail": ""}


def bench_mooncake(num_senders: int, total: int, bucket_bytes: int) -> dict[str, Any] | str:
    """Inside a private network namespace (Mooncake binds every interface)."""
    if shutil.which("unshare") is None:
        return "unshare not available"
    code = (
        f"import json, sys; sys.path[:0] = {sys.path!r}\n"
        "from relayrl.weightsync.transports.measure import measure_transport_gbps\n"
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
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {"gbps": r["gbps"], "extra_buckets": r["peak_extra_bytes"] / bucket_bytes, "detail": ""}


def fp8_ratio(gib: float) -> float:
    from relayrl.weightsync.sender import export_tensors

    tensors = synthetic_model(gib)
    bf16, _ = export_tensors(tensors, "none")
    fp8, _ = export_tensors(tensors, "fp8_block_128")

    def size(d: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in d.values())

    return size(fp8) / size(bf16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model size in GiB (bf16)")
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    from relayrl.weightsync.transports.measure import measure_loopback_tcp_gbps

    bucket = args.bucket_mib << 20
    total = int(args.gib * 2**30)
    limit = measure_loopback_tcp_gbps(total)
    rows: list[tuple[str, int, Any]] = []
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        for senders in (1, 2):
            rows.append(("grpc", senders, bench_grpc(args.gib, senders, bucket, Path(tmp))))
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
    print(f"loopback TCP between two processes: {limit:.2f} GB/s")
    print(f"{'transport':<18}{'senders':>8}{'GB/s':>8}{'ratio':>8}{'extra':>8}  detail")
    best = ("none", 0.0)
    for name, senders, r in rows:
        if isinstance(r, str):
            print(f"{name:<18}{senders:>8}{'-':>8}{'-':>8}{'-':>8}  {r}")
            continue
        print(
            f"{name:<18}{senders:>8}{r['gbps']:>8.2f}{r['gbps'] / limit:>8.2f}"
            f"{r['extra_buckets']:>8.2f}  {r['detail']}"
        )
        if r["gbps"] > best[1]:
            best = (name, r["gbps"])
    ratio = fp8_ratio(args.gib)
    print(f"weightsync-bench: best={best[0]} ratio={best[1] / limit:.2f} fp8_bytes={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
