"""The NCCL data plane where GPUs exist: a ~1 GiB bf16-sized model in 64 MiB buckets broadcast
by weight-sync's torch_distributed transport (device cuda: NCCL) from one sender process to two
receiver processes, each on its own GPU, next to the device-to-device copy bandwidth measured
on the same GPUs in the same run. A few minutes at most.

    d2d    one GPU copying a 1 GiB buffer to another (cudaMemcpy peer), best of 3
    nccl   GB/s each receiver gets, and its ratio to d2d

NCCL puts one rank on one GPU, so the broadcast needs 3 GPUs; with fewer, the script measures
d2d, says what is missing and exits 2. `--device cpu` runs the same harness over gloo, to check
the script itself on a machine without a GPU.

The last line is exactly:
    nccl-check: gbps=<per receiver> d2d_gbps=<copy> ratio=<gbps / d2d> ok=<true|false>
(ok: the transfer completed and every receiver got every bucket.)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def d2d_gbps(total_bytes: int, repeats: int = 3) -> float:
    """Best GB/s of copying `total_bytes` from GPU 0 to GPU 1 (or within GPU 0 if alone)."""
    source = torch.empty(total_bytes, dtype=torch.uint8, device="cuda:0")
    target_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    target = torch.empty(total_bytes, dtype=torch.uint8, device=target_device)
    best = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize(target_device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize(target_device)
        best = max(best, total_bytes / (time.perf_counter() - start) / 1e9)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    total = int(args.gib * 2**30)

    from relayrl.dataplane.transports.measure import measure_transport_gbps

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("nccl-check: no CUDA device visible; run it where GPUs are (or --device cpu)")
            return 2
        gpus = torch.cuda.device_count()
        copy = d2d_gbps(total)
        print(f"d2d copy: {copy:.1f} GB/s ({'GPU 0 -> 1' if gpus > 1 else 'within GPU 0'})")
        if gpus < 3:
            print(f"nccl-check: needs 3 GPUs (a sender and two receivers), found {gpus}; "
                  f"gbps=- d2d_gbps={copy:.1f} ratio=- ok=false")  # fmt: skip
            return 2
    else:
        copy = float("nan")
    started = time.perf_counter()
    result = measure_transport_gbps(
        "torch_distributed", 1, 2, total, args.bucket_mib << 20, device=args.device
    )
    print(
        f"{'nccl' if args.device == 'cuda' else 'gloo'}: {result['gbps']:.2f} GB/s per receiver, "
        f"{result['num_buckets']} buckets in {result['elapsed_s']:.2f} s "
        f"(whole check {time.perf_counter() - started:.1f} s)"
    )
    ratio = result["gbps"] / copy if args.device == "cuda" else float("nan")
    print(f"nccl-check: gbps={result['gbps']:.2f} d2d_gbps={copy:.1f} ratio={ratio:.2f} ok=true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
