"""`python -m disagg.testing {up,down}`: a local Kubernetes control plane plus kubelet."""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.testing.daemon import default_runtime_dir, down, serve, up


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.testing", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "serve"],
                        help="up: start in the background; down: stop; serve: run in the foreground")
    parser.add_argument("--runtime-dir", type=Path, default=default_runtime_dir(),
                        help="state, logs and kubeconfigs (default: %(default)s)")
    args = parser.parse_args()
    commands = {"up": up, "down": down, "serve": serve}
    return commands[args.command](args.runtime_dir)


if __name__ == "__main__":
    raise SystemExit(main())
