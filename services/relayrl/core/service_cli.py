"""The command line every service shares: `relayrl-<service> [--config FILE] [--print-config]`.

Arguments are parsed before anything is imported beyond argparse, so `--help` answers at once;
the config class and the service itself are named by dotted path and imported only when
needed. A user mistake ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_USAGE = 2


def service_command(
    prog: str,
    *,
    description: str,
    config: str,
    serve: str | None,
    unavailable_reason: str = "",
) -> Callable[[Sequence[str] | None], int]:
    """The console-script entry point of one service.

    `config` names its ServiceConfig subclass and `serve` its
    `serve(config, ready_file: Path | None) -> exit code` function, as `module:attribute`;
    `--ready-file` asks the service to write its bound ports there once it serves (see
    `relayrl.core.grpc_server.write_ready_file`), which is how a supervisor or a test learns
    the ports chosen for `port: 0`. `serve=None` marks a service whose behaviour has not landed
    yet: its config is still fully validated (so deployments can be checked), and the command
    says so and exits 2. The environment prefix comes from `prog` (relayrl-reward ->
    RELAYRL_REWARD)."""
    env_prefix = prog.upper().replace("-", "_")

    def main(argv: Sequence[str] | None = None) -> int:
        args = _parser(prog, description, env_prefix).parse_args(argv)
        from relayrl.core.config import ConfigError, dump_config, load_config
        from relayrl.core.dotted import import_object

        try:
            loaded = load_config(import_object(config, prog), args.config, env_prefix)
        except ConfigError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if args.print_config:
            sys.stdout.write(dump_config(loaded))
            return 0
        if serve is None:
            print(
                f"{prog}: not available yet: {unavailable_reason} "
                "(--print-config already checks a configuration)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        ready_file = Path(args.ready_file) if args.ready_file else None
        return import_object(serve, prog)(loaded, ready_file)

    return main


def _parser(prog: str, description: str, env_prefix: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every config field can be overridden by an environment variable "
        f"{env_prefix}__<SECTION>__<FIELD> (e.g. {env_prefix}__GRPC__PORT=50051).",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config file (default: defaults)")
    parser.add_argument(
        "--ready-file",
        metavar="FILE",
        help="once serving, write the bound ports and the PID to FILE as JSON",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (file + environment) as YAML and exit",
    )
    return parser
