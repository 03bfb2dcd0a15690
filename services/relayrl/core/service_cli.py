"""The command line every service shares: `relayrl-<service> [--config FILE] [--print-config]`.

Config is parsed and validated before anything heavy is imported, so `--help` and config
mistakes answer at once. A user mistake ends with one line on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from relayrl.core.config import ConfigError, ServiceConfig, dump_config, load_config

ConfigT = TypeVar("ConfigT", bound=ServiceConfig)

EXIT_USAGE = 2


def service_command(
    prog: str,
    *,
    description: str,
    config_cls: type[ConfigT],
    serve: Callable[[ConfigT], int] | None,
    unavailable_reason: str = "",
) -> Callable[[Sequence[str] | None], int]:
    """The console-script entry point of one service; its environment prefix is derived from
    `prog` (relayrl-reward -> RELAYRL_REWARD)."""

    def main(argv: Sequence[str] | None = None) -> int:
        return service_main(
            prog=prog,
            description=description,
            config_cls=config_cls,
            env_prefix=prog.upper().replace("-", "_"),
            serve=serve,
            unavailable_reason=unavailable_reason,
            argv=argv,
        )

    return main


def service_main(
    *,
    prog: str,
    description: str,
    config_cls: type[ConfigT],
    env_prefix: str,
    serve: Callable[[ConfigT], int] | None,
    unavailable_reason: str = "",
    argv: Sequence[str] | None = None,
) -> int:
    """Parses arguments and config, then runs `serve(config)` and returns its exit code.

    `serve=None` marks a service whose behaviour has not landed yet: the config is still fully
    validated (so deployments can be checked), and the command says so and exits 2."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every config field can be overridden by an environment variable "
        f"{env_prefix}__<SECTION>__<FIELD> (e.g. {env_prefix}__GRPC__PORT=50051).",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config file (default: defaults)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (file + environment) as YAML and exit",
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(config_cls, args.config, env_prefix)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_config:
        sys.stdout.write(dump_config(config))
        return 0
    if serve is None:
        print(
            f"{prog}: not available yet: {unavailable_reason} "
            "(--print-config already checks a configuration)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return serve(config)
