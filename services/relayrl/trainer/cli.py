"""`relayrl-trainer`: the trainer (megatron-core GRPO/PPO on scored groups), and
`relayrl-trainer sft`, the supervised warm start that writes an HF folder.

Both parse their arguments before importing torch or megatron, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from relayrl.core.service_cli import EXIT_USAGE, service_command

serve_main = service_command(
    "relayrl-trainer",
    description="the trainer: megatron-core GRPO/PPO on scored groups "
    "(`relayrl-trainer sft --help`: the supervised warm start).",
    config="relayrl.trainer.config:TrainerConfig",
    serve="relayrl.trainer.server:serve",
)


def _sft_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relayrl-trainer sft",
        description="Supervised warm start on prompt/answer pairs; writes an HF folder.",
    )
    parser.add_argument("--model", required=True, type=Path, help="HF folder to start from")
    parser.add_argument(
        "--data",
        required=True,
        type=Path,
        help='JSONL: {"prompt": str | "messages": [...], "answer": str} per line',
    )
    parser.add_argument("--out", required=True, type=Path, help="HF folder to write (new)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs (at most, with a target)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--warmup-updates", type=int, default=0, help="linear warm-up of the lr, in updates"
    )
    parser.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="after the warm-up: constant, or cosine down to --min-lr over all --epochs",
    )
    parser.add_argument("--min-lr", type=float, default=0.0, help="floor of the cosine")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per update")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-data",
        type=Path,
        help="JSONL held aside (same format): its expected sampled accuracy after each epoch",
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        help="stop at the first check whose --eval-data accuracy reaches this (0..1)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also check the --eval-data accuracy every this many updates (0: per epoch)",
    )
    return parser


def sft_main(argv: Sequence[str]) -> int:
    args = _sft_parser().parse_args(argv)
    problems = [
        f"--{name.replace('_', '-')} must be >= 1"
        for name in ("epochs", "batch_size", "micro_batch_size", "max_seq_len")
        if getattr(args, name) < 1
    ]
    for name in ("warmup_updates", "eval_every"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 <= args.min_lr <= args.lr:
        problems.append("--min-lr must be between 0 and --lr")
    if args.lr <= 0:
        problems.append("--lr must be > 0")
    elif args.lr > 1:  # the bound of OptimizerConfig.lr, which the warm start builds
        problems.append("--lr must be <= 1")
    if args.target_accuracy is not None and not (
        args.eval_data is not None and 0.0 < args.target_accuracy <= 1.0
    ):
        problems.append("--target-accuracy needs --eval-data and a value in (0, 1]")
    if not (args.model / "config.json").is_file():
        problems.append(f"--model {args.model}: no config.json (make one: relayrl model init DIR)")
    if args.out.exists():
        problems.append(f"--out {args.out} exists; give a new folder")
    if problems:
        print(f"relayrl-trainer sft: {problems[0]}", file=sys.stderr)
        return EXIT_USAGE
    import os

    from relayrl.core.ports import free_port
    from relayrl.trainer.server import quiet_megatron
    from relayrl.trainer.sft import SftConfig, SftDataError, run_sft

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_megatron("INFO")

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        )  # fmt: skip
    settings = SftConfig(
        model=args.model,
        data=args.data,
        out=args.out,
        epochs=args.epochs,
        lr=args.lr,
        warmup_updates=args.warmup_updates,
        schedule=args.schedule,
        min_lr=args.min_lr,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        eval_data=args.eval_data,
        target_accuracy=args.target_accuracy,
        eval_every=args.eval_every,
    )
    try:
        result = run_sft(settings)
    except SftDataError as exc:
        print(f"relayrl-trainer sft: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps({"out": str(args.out), **result}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sft"]:
        return sft_main(argv[1:])
    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
