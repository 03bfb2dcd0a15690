"""`relayrl`: the operator's command line.

    relayrl up                    run the whole system locally and train (the main job)
    relayrl tq counts             prompt groups and trajectories by status, per partition
    relayrl tq events PARTITION   the last transitions of a partition

User mistakes (bad arguments, unreachable Redis) end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_USAGE = 2


def _tq_from_args(args: argparse.Namespace):
    # Imported here so that `relayrl --help` stays instant.
    from relayrl.tq import TQConfig, TransferQueue

    config = TQConfig(url=args.url, namespace=args.namespace, partitions=[])
    return TransferQueue.from_config(config)


def cmd_up(args: argparse.Namespace) -> int:
    print(
        "relayrl up: not yet available: the end-to-end run (redis, the four services, a vLLM "
        "engine and GRPO on the built-in task) lands with issue #7. Today: `make test`, "
        "`make bench-tq`, and `relayrl tq counts` against a running Redis.",
        file=sys.stderr,
    )
    return EXIT_USAGE


def cmd_tq_counts(args: argparse.Namespace) -> int:
    tq = _tq_from_args(args)
    partitions = args.partition or tq.partitions()
    if not partitions:
        print(f"no partitions in namespace {args.namespace!r} at {args.url}")
        return 0
    for partition in partitions:
        counts = tq.counts(partition)
        groups = " ".join(f"{s.value}={n}" for s, n in counts.groups.items())
        trajectories = " ".join(f"{s.value}={n}" for s, n in counts.trajectories.items())
        print(
            f"{partition}: groups {groups} | trajectories {trajectories} | "
            f"launched={counts.num_launched}"
        )
    return 0


def cmd_tq_events(args: argparse.Namespace) -> int:
    tq = _tq_from_args(args)
    if args.partition not in tq.partitions():
        print(
            f"relayrl tq events: no partition {args.partition!r} in namespace {args.namespace!r}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    events = tq.redis.xrevrange(f"{tq.key_prefix(args.partition)}events", count=args.count)
    for entry_id, fields in reversed(events):
        f = {k.decode(): v.decode() for k, v in fields.items()}
        extra = " ".join(f"{k}={v}" for k, v in f.items() if k not in ("kind", "key", "from", "to"))
        print(
            f"{entry_id.decode()} {f.get('kind')} {f.get('key')} "
            f"{f.get('from') or '-'} -> {f.get('to')} {extra}".rstrip()
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relayrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the whole system locally and train (the main job)")
    up.set_defaults(func=cmd_up)

    tq = sub.add_parser("tq", help="inspect the TransferQueue")
    tq.add_argument("--url", default="redis://127.0.0.1:6379/0", help="Redis URL")
    tq.add_argument("--namespace", default="relayrl", help="TransferQueue namespace")
    tq_sub = tq.add_subparsers(dest="tq_command", required=True)
    counts = tq_sub.add_parser("counts", help="groups and trajectories by status")
    counts.add_argument("partition", nargs="*", help="partitions (default: all)")
    counts.set_defaults(func=cmd_tq_counts)
    events = tq_sub.add_parser("events", help="the last transitions of a partition")
    events.add_argument("partition")
    events.add_argument("-n", "--count", type=int, default=20, help="how many (default 20)")
    events.set_defaults(func=cmd_tq_events)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from relayrl.tq import TQError  # after parsing: --help must not import redis

    try:
        return args.func(args)
    except (TQError, ValueError) as exc:
        print(f"relayrl {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
