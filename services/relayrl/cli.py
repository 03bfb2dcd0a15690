"""`relayrl`: the operator's command line.

    relayrl up                    run the whole system locally and train (the main job)
    relayrl status [RUN_DIR]      the state of a run's stack (health, versions, queue)
    relayrl audit RUN_DIR         a stopped run: nothing lost or trained twice, no stale weights
    relayrl tq counts             prompt groups and trajectories by status, per partition
    relayrl tq events PARTITION   the last transitions of a partition
    relayrl tq redrive PARTITION  put dead letters back into the event stream
    relayrl model init DIR        write a tiny Qwen2 model and its tokenizer, built from a seed
    relayrl model import-gguf FILE DIR   a GGUF checkpoint as a Hugging Face model folder
    relayrl engine [MODEL]        start a vLLM engine replica with relayrl's worker extension
    relayrl sim                   simulate a rollout pipeline design (throughput, staleness)

User mistakes (bad arguments, unreachable Redis) end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

EXIT_USAGE = 2


def _tq_from_args(args: argparse.Namespace):
    # Imported here so that `relayrl --help` stays instant.
    from relayrl.tq import TQConfig, TransferQueue

    config = TQConfig(url=args.url, namespace=args.namespace, partitions=[])
    return TransferQueue.from_config(config)


def _up_config(args: argparse.Namespace):
    """The run's config: the file (or the resumed run's), then the flags; ValueError (one
    line) for a mistake."""
    from pydantic import ValidationError

    from relayrl.core.config import ConfigError, load_config
    from relayrl.up.config import UpConfig

    if args.resume is not None:
        from relayrl.up.run import load_run_config

        own = (args.config, args.task, args.mode, args.model, args.data, args.heldout, args.agent)
        if any(own) or args.eta is not None or args.env_reward or args.agent_serve:
            raise ValueError("--resume continues a run with its own config; give only --steps")
        config = load_run_config(args.resume)
    else:
        try:
            config = load_config(UpConfig, args.config, "RELAYRL_UP")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    data = config.model_dump(mode="json")
    flags = {"task": ("task", "name"), "mode": ("train", "mode"), "eta": ("train", "eta")}
    flags |= {"steps": ("train", "steps"), "runs_dir": ("runs_dir",)}
    flags |= {"model": ("model", "path"), "data": ("data", "train_files")}
    flags |= {"heldout": ("data", "heldout_files"), "agent": ("agent", "command")}
    if args.task is not None and args.data:
        raise ValueError("--task and --data: the data files are the task; give one of them")
    for flag, path in flags.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if flag == "agent":
            value = _agent_argv(value)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, list):
            value = [str(v) for v in value]
        if len(path) == 1:
            data[path[0]] = value
        else:
            data[path[0]][path[1]] = value
    if args.env_reward:
        data["reward"]["env"] = True
    if args.agent_serve:
        data["agent"]["serve"] = True
    if args.mode is not None and args.eta is None and (args.resume or args.config):
        data["train"]["eta"] = None  # the mode's own default, not the file's eta
    try:
        return UpConfig.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {message}" if where else message) from None


def cmd_up(args: argparse.Namespace) -> int:
    config = _up_config(args)
    if args.print_config:
        from relayrl.core.config import dump_config

        print(dump_config(config), end="")
        return 0
    # Every path a child process sees is absolute: a child runs in its own folder (Redis even
    # changes into its data dir before it opens its log), where a relative path names
    # something else.
    config = _absolute_paths(config)
    if config.hosts.isolate:
        from relayrl.up.hosts import missing_for_hosts

        if (missing := missing_for_hosts()) is not None:
            raise ValueError(f"hosts.isolate {missing}")
    workload = _checked_workload(config)  # every usage error before anything starts
    from relayrl.up.run import Run, new_run_dir
    from relayrl.up.run_state import ENDED, RUN_FILE, RunState

    if args.resume is not None:
        run_dir = args.resume.absolute()
        if not RunState.exists(run_dir):
            raise ValueError(f"{run_dir} holds no relayrl run (no {RUN_FILE}) to resume")
        state = RunState.read(run_dir).state
        if state not in ENDED and _run_alive(run_dir):
            raise ValueError(f"{run_dir} is running now (see `relayrl status {run_dir}`)")
    else:
        run_dir = new_run_dir(config.runs_dir)
    return Run(config, run_dir, resume=args.resume is not None, workload=workload).main()


def _agent_argv(command: str) -> list[str]:
    import shlex

    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"--agent {command!r}: {exc}") from None
    if not argv:
        raise ValueError("--agent: give the agent's command, e.g. --agent 'python my_agent.py'")
    return argv


def _absolute_paths(config):
    data = config.data
    updates = {
        "runs_dir": config.runs_dir.absolute(),
        "data": data.model_copy(
            update={
                "train_files": [p.absolute() for p in data.train_files],
                "heldout_files": [p.absolute() for p in data.heldout_files],
            }
        ),
    }
    if config.model.path is not None:
        updates["model"] = config.model.model_copy(update={"path": config.model.path.absolute()})
    if config.agent.command is not None:
        cwd = (config.agent.cwd or Path.cwd()).absolute()
        updates["agent"] = config.agent.model_copy(update={"cwd": cwd})
    return config.model_copy(update=updates)


def _checked_workload(config):
    """The run's workload, with the user's model checked against it: the family, the chat
    template, and every prompt's length; ValueError (one line) for the first mistake."""
    from relayrl.up.prepare import max_tokens
    from relayrl.up.workload import (
        check_agent_command,
        check_model_dir,
        check_prompt_lengths,
        load_workload,
    )

    if config.model.path is not None:
        check_model_dir(config.model.path)
    if config.agent.command is not None:
        check_agent_command(config.agent.command, config.agent.cwd)
    workload = load_workload(config)
    if config.model.path is not None:
        check_prompt_lengths(
            workload.train + workload.heldout, config.model.path,
            config.engine.max_model_len, max_tokens(config),
        )  # fmt: skip
    return workload


def _run_alive(run_dir: Path) -> bool:
    """Whether a run's `relayrl up` still holds its children (its trainer PID is alive)."""
    import os

    from relayrl.up.stack_state import StackState

    try:
        pid = StackState.read(run_dir).pid("trainer")
        if pid is None:
            return False
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def cmd_status(args: argparse.Namespace) -> int:
    from relayrl.up.run_state import RunState
    from relayrl.up.status import latest_run, status_lines

    run_dir = args.run_dir or latest_run(args.runs_dir)
    if run_dir is None or not RunState.exists(run_dir):
        where = args.run_dir or args.runs_dir
        raise ValueError(f"no relayrl run in {where} (start one with `relayrl up`)")
    for line in status_lines(run_dir):
        print(line)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    import json

    from relayrl.up.audit import audit_run

    run_dir = args.run_dir
    if not (run_dir / "redis").is_dir():
        raise ValueError(f"{run_dir} is not a relayrl run (no redis/ folder)")
    if _run_alive(run_dir):
        raise ValueError(f"{run_dir} is running now: stop it first (its Redis is in use)")
    report = audit_run(run_dir)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        for name in ("trained_twice", "lost", "stale_served", "prompts_lost"):
            for line in getattr(report, name)[: args.max_lines]:
                print(f"{name}: {line}")
        print(report.summary())
    return 0 if report.ok else 1


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
    for e in tq.last_events(args.partition, args.count):
        extra = " ".join(f"{k}={v}" for k, v in e.extra.items())
        print(f"{e.id} {e.kind} {e.key} {e.from_status or '-'} -> {e.to_status} {extra}".rstrip())
    return 0


def cmd_tq_redrive(args: argparse.Namespace) -> int:
    """Dead letters back into their event stream (after the cause is fixed)."""
    tq = _tq_from_args(args)
    if args.partition not in tq.partitions():
        raise ValueError(f"no partition {args.partition!r} in namespace {args.namespace!r}")
    letters = tq.dead_letters(args.partition, args.count)
    if args.id:
        known = {e.id for e in letters}
        missing = [i for i in args.id if i not in known]
        if missing:
            raise ValueError(f"{', '.join(missing)}: not dead letters of {args.partition!r}")
        letters = [e for e in letters if e.id in set(args.id)]
    if not letters:
        print(f"{args.partition}: no dead letters")
        return 0
    for e in letters:
        print(
            f"{e.id} {e.kind} {e.key} -> {e.to_status} (group {e.extra.get('dead_group')}, "
            f"{e.extra.get('dead_deliveries')} deliveries)"
        )
    if args.dry_run:
        print(f"{args.partition}: {len(letters)} dead letters (not re-driven: --dry-run)")
        return 0
    added = tq.redrive_dead_letters(args.partition, [e.id for e in letters])
    print(f"{args.partition}: re-drove {len(added)} dead letters into the event stream")
    return 0


# `relayrl model init` flags that set a TinyModelConfig field of the same name.
MODEL_INIT_FIELDS = (
    "seed",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
)


def cmd_model_init(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from relayrl.models import TinyModelConfig  # pydantic only: mistakes are reported at once

    given = {
        name: getattr(args, name) for name in MODEL_INIT_FIELDS if getattr(args, name) is not None
    }
    try:
        config = TinyModelConfig(**given)
    except ValidationError as exc:
        raise ValueError("; ".join(_flag_error(e) for e in exc.errors(include_url=False))) from None
    from relayrl.models.tiny import init_model  # torch, transformers

    try:
        info = init_model(args.directory, config, overwrite=args.force)
    except OSError as exc:
        raise ValueError(f"cannot write {args.directory}: {exc.strerror or exc}") from None
    print(f"wrote a tiny Qwen2: {info.summary()}")
    return 0


def cmd_model_import_gguf(args: argparse.Namespace) -> int:
    from relayrl.models.gguf import GgufImportError, import_gguf

    try:
        imported = import_gguf(args.file, args.directory, dtype=args.dtype, overwrite=args.force)
    except GgufImportError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"cannot write {args.directory}: {exc.strerror or exc}") from None
    print(f"imported {args.file}: {imported.summary()}")
    return 0


def _flag_error(error: ErrorDetails) -> str:
    """A validation error in the words of the command line: `--hidden-size: ...`."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    return f"--{str(error['loc'][0]).replace('_', '-')}: {message}"


def _add_model_parser(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser(
        "model", help="build the tiny model, or import a GGUF checkpoint as a Hugging Face folder"
    )
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser(
        "init",
        help="write a tiny Qwen2 model (random weights from a seed) and its tokenizer into DIR",
        description="Train a byte-level BPE tokenizer on a generated corpus and save it with a "
        "randomly initialized Qwen2 causal LM (fp32 safetensors) in Hugging Face format. "
        "Unset sizes take TinyModelConfig's defaults (about 0.5M parameters).",
    )
    init.add_argument("directory", type=Path, metavar="DIR", help="where to write the model")
    init.add_argument("--seed", type=int, help="seed of the weight init (default 0)")
    init.add_argument("--vocab-size", type=int, help="tokens in the vocabulary (default 512)")
    init.add_argument("--hidden-size", type=int, help="residual width (default 128)")
    init.add_argument("--num-layers", type=int, help="decoder layers (default 3)")
    init.add_argument("--num-heads", type=int, help="query heads (default 4)")
    init.add_argument("--num-kv-heads", type=int, help="key/value heads (default 2)")
    init.add_argument("--intermediate-size", type=int, help="MLP width (default 256)")
    init.add_argument("--force", action="store_true", help="write over a non-empty DIR")
    init.set_defaults(func=cmd_model_init)
    imports = model_sub.add_parser(
        "import-gguf",
        help="write a GGUF checkpoint (llama.cpp) as a Hugging Face model folder DIR",
        description="Dequantise a GGUF checkpoint of a family relayrl trains (llama, qwen2) "
        "with transformers and save it as config.json, safetensors, tokenizer and chat "
        "template: what `relayrl up --model DIR` and vLLM load.",
    )
    imports.add_argument("file", type=Path, metavar="FILE.gguf", help="the GGUF checkpoint")
    imports.add_argument("directory", type=Path, metavar="DIR", help="where to write the model")
    imports.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16", help="weights on disk (bf16)"
    )
    imports.add_argument("--force", action="store_true", help="write over a non-empty DIR")
    imports.set_defaults(func=cmd_model_import_gguf)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relayrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="run the whole system locally and train (the main job)",
        description="Start a private redis-server, the four services and a vLLM engine, "
        "and train with GRPO: the tiny model (warm-started) on a built-in task by default, or "
        "your own model folder on your own data files or a reasoning-gym task; report in "
        "runs/<id>/report.html. Ctrl-C stops cleanly; --resume continues.",
    )
    up.add_argument("--config", type=Path, help="YAML file (relayrl up --print-config: fields)")
    up.add_argument(
        "--task",
        metavar="NAME",
        help="arith, lookup or reasoning_gym:<dataset> (default arith)",
    )
    up.add_argument(
        "--model", type=Path, metavar="DIR", help="a Hugging Face model folder (model.path)"
    )
    up.add_argument(
        "--data",
        type=Path,
        action="append",
        metavar="FILE",
        help="training data, .jsonl or .parquet in verl's layout (data.train_files; repeatable)",
    )
    up.add_argument(
        "--heldout",
        type=Path,
        action="append",
        metavar="FILE",
        help="held-out data (data.heldout_files; repeatable; default: a hash split of --data)",
    )
    up.add_argument(
        "--agent",
        metavar="COMMAND",
        help="your agent program, run once per training sample with OPENAI_BASE_URL and "
        "OPENAI_API_KEY set to its session (agent.command; e.g. 'python my_agent.py')",
    )
    up.add_argument(
        "--agent-serve",
        action="store_true",
        help="one long-running agent process takes every sample's task as a JSON line on "
        "stdin (agent.serve), for an agent slow to start",
    )
    up.add_argument(
        "--env-reward",
        action="store_true",
        help="score with the reward the agent's environment reports at its close (reward.env; "
        "e.g. examples/agents/verifiers_agent.py)",
    )
    up.add_argument(
        "--mode",
        choices=("sync", "colocate_async", "separate_async"),
        help="trainer mode (default separate_async)",
    )
    up.add_argument("--eta", type=int, help="versions rollout may run ahead (default: by mode)")
    up.add_argument("--steps", type=int, help="trainer steps")
    up.add_argument("--runs-dir", type=Path, help="where runs go (default runs/)")
    up.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a stopped run")
    up.add_argument("--print-config", action="store_true", help="print the config and exit")
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="the state of a running (or finished) run")
    status.add_argument("run_dir", type=Path, nargs="?", help="runs/<id> (default: the latest)")
    status.add_argument("--runs-dir", type=Path, default=Path("runs"), help="default runs/")
    status.set_defaults(func=cmd_status)

    audit = sub.add_parser(
        "audit",
        help="check a stopped run: no group lost or trained twice, no stale weights served",
    )
    audit.add_argument("run_dir", type=Path, help="runs/<id>")
    audit.add_argument("--json", action="store_true", help="the whole report as JSON")
    audit.add_argument("--max-lines", type=int, default=20, help="violations shown per kind")
    audit.set_defaults(func=cmd_audit)

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
    redrive = tq_sub.add_parser(
        "redrive", help="put dead letters back into their event stream (after a fix)"
    )
    redrive.add_argument("partition")
    redrive.add_argument("--id", action="append", help="only this dead-letter id (repeatable)")
    redrive.add_argument("-n", "--count", type=int, default=1000, help="at most (default 1000)")
    redrive.add_argument("--dry-run", action="store_true", help="list them, change nothing")
    redrive.set_defaults(func=cmd_tq_redrive)
    _add_model_parser(sub)
    engine = sub.add_parser(
        "engine",
        add_help=False,  # its own parser answers --help
        help="start a vLLM engine replica (relayrl engine --help for its options)",
    )
    engine.add_argument("rest", nargs=argparse.REMAINDER)
    engine.set_defaults(func=cmd_engine)
    from relayrl.sim.cli import add_parser as add_sim_parser  # argparse only: --help stays instant

    add_sim_parser(sub)
    return parser


def cmd_engine(args: argparse.Namespace) -> int:
    from relayrl.engine.launcher import main as engine_main

    return engine_main(args.rest, prog="relayrl engine")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:  # its own parser, flags and --help included
        return cmd_engine(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    from relayrl.tq import TQError  # after parsing: --help must not import redis

    try:
        return args.func(args)
    except (TQError, ValueError) as exc:
        print(f"relayrl {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
