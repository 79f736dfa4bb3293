"""The `disagg` command: one subcommand per way of running the project."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from disagg.workers import __version__

# name -> (help, add its arguments, run it). Only the chosen subcommand's
# arguments are added, and each one imports its heavy modules (torch, kopf,
# grpc) inside these functions, so `disagg --help` and `--version` stay fast.
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


def _add_link_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.workers.pd.commands import add_link_arguments

    add_link_arguments(p)


def _run_link(args: argparse.Namespace) -> int:
    from disagg.workers.pd.commands import run_link

    return run_link(args)


def _run_unlink(args: argparse.Namespace) -> int:
    from disagg.workers.pd.commands import run_unlink

    return run_unlink(args)


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.workers.demo import add_demo_arguments

    add_demo_arguments(p)


def _run_demo(args: argparse.Namespace) -> int:
    from disagg.workers.demo import run_demo

    return run_demo(args)


def _add_operator_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.operator.main import add_arguments

    add_arguments(p)


def _run_operator(args: argparse.Namespace) -> int:
    from disagg.operator.main import run

    return run(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": ("Run a worker: the OpenAI API, and the PD service for the prefill and decode roles.",
              _add_serve_arguments, _run_serve),
    "link": ("Link a decode to a prefill (LinkInstance on the decode, payload = the prefill).",
             _add_link_arguments, _run_link),
    "unlink": ("Unlink a decode from a prefill (UnlinkInstance on both sides).", _add_link_arguments, _run_unlink),
    "demo": ("Run a prefill and a decode here with the embedded default model, answer a few chat prompts "
             "and show what happened.", _add_demo_arguments, _run_demo),
    "operator": ("Run the DisaggCluster operator (Kubernetes).", _add_operator_arguments, _run_operator),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s own arguments are added (None: none, enough for --help)."""
    parser = argparse.ArgumentParser(
        prog="disagg",
        description="Prefill/decode disaggregated LLM serving on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            add_arguments(p)
        p.set_defaults(run=run)
    return parser


# libgomp's spin count for a worker that owns its CPUs: iterations of a pause loop, tens of
# milliseconds, so that its threads stay awake from one parallel region to the next during
# steps and sleep once the worker is idle (docs/benchmarks.md, "OpenMP threads that own their CPUs").
OWNED_CPUS_SPIN_COUNT = "1000000"
# ... and for a worker taking CPU turns (workers/pd/cpu_turns.py): about 2.5 ms, from one region
# to the next of a step it takes alone, and soon asleep once the turn passes.
TURN_SPIN_COUNT = "100000"


def _takes_cpu_turns(argv: Sequence[str]) -> bool:
    return any(a.split("=")[0] == "--cpu-turn-dir" for a in argv)


def _owns_its_cpus(argv: Sequence[str]) -> bool:
    """A mixed worker not taking CPU turns: the only compute on its CPUs, as far as it knows."""
    mixed = any(a == "--role=mixed" or (a == "--role" and b == "mixed") for a, b in zip(argv, [*argv[1:], ""]))
    return mixed and not _takes_cpu_turns(argv)


def _set_openmp_wait_policy(argv: Sequence[str]) -> None:
    """How idle OpenMP threads wait, unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT).

    A prefill and a decode on the same cores without turns must not spin:
    libgomp's spinning after each parallel region made them burn each other's
    CPU time, so they sleep at once (PASSIVE). A mixed worker that owns its CPUs
    spins a while instead: waking sleeping threads for each of a step's few
    hundred parallel regions made its decode steps up to 1.45x slower
    (docs/benchmarks.md). Workers taking CPU turns spin briefly: they step on
    every thread only while alone on the cores, on one beside each other.
    NOTE: libgomp reads these once, when torch loads, so this runs before any
    subcommand imports it; the workers `disagg demo` starts inherit it.
    """
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if _owns_its_cpus(argv):
        os.environ["GOMP_SPINCOUNT"] = OWNED_CPUS_SPIN_COUNT
    elif _takes_cpu_turns(argv):
        os.environ["GOMP_SPINCOUNT"] = TURN_SPIN_COUNT
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _set_openmp_wait_policy(argv)
    # The first word that names a subcommand is the subcommand (no top-level option takes a value).
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
