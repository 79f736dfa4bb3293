"""The `disagg` command: one subcommand per way of running the project."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from disagg.workers import __version__

# name -> (help, add its arguments, run it). Each subcommand imports its heavy
# modules inside `run`, so `disagg --help` stays fast.
Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.workers.args import add_serve_arguments

    add_serve_arguments(p)


def _run_serve(args: argparse.Namespace) -> int:
    from disagg.workers.args import build_configs
    from disagg.workers.server import run

    try:
        engine_config, server_config = build_configs(args)
    except ValueError as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    return run(engine_config, server_config)


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": ("Run a worker: the OpenAI API, and the PD service for the prefill and decode roles.",
              _add_serve_arguments, _run_serve),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg",
        description="Prefill/decode disaggregated LLM serving on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
