"""`python -m disagg.testing {up,down,demo}`: a local Kubernetes control plane plus kubelet."""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.testing.daemon import default_runtime_dir, down, serve, up
from disagg.testing.k8s_demo import demo


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.testing", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "serve", "demo"],
                        help="up: start in the background; down: stop; serve: run in the foreground; "
                             "demo: up, then the operator's demo (helm, kubectl)")
    parser.add_argument("--runtime-dir", type=Path, default=default_runtime_dir(),
                        help="state, logs and kubeconfigs (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="demo: leave the cluster up at the end")
    args = parser.parse_args()
    if args.command == "demo":
        return demo(args.runtime_dir, keep=args.keep)
    commands = {"up": up, "down": down, "serve": serve}
    return commands[args.command](args.runtime_dir)


if __name__ == "__main__":
    raise SystemExit(main())
