"""`disagg operator`: run the kopf operator in-cluster or from a kubeconfig."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf

from disagg.operator.settings import OperatorSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; default: DISAGG_OPERATOR_NAMESPACE, "
                        "else all namespaces)")
    p.add_argument("--kubeconfig", default=None,
                   help="out of a cluster: the kubeconfig to use (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--standalone", action="store_true",
                   help="no peering with other operator replicas (tests and local runs only)")
    p.add_argument("--liveness-port", type=_port_or_none, default=8081,
                   help="serve the liveness endpoint /healthz on this port (0: none; default %(default)s)")
    p.add_argument("--verbose", action="store_true", help="debug logging")


def _port_or_none(text: str) -> int:
    """An argparse type: a port number, or 0 for none."""
    if not (text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"expected a port from 0 (none) to 65535, got {text!r}")
    return int(text)


def run_operator(namespaces: list[str], standalone: bool = False, kubeconfig: str | None = None,
                 liveness_port: int = 8081, verbose: bool = False) -> int:
    """Blocks until the operator stops. Operator settings come from DISAGG_OPERATOR_* (see settings.py)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = OperatorSettings.from_env()
    except ValueError as e:
        print(f"disagg operator: {e}", file=sys.stderr)
        return 2
    if kubeconfig is not None and not os.access(kubeconfig, os.R_OK):  # kopf would retry it every minute
        print(f"disagg operator: cannot read the kubeconfig {kubeconfig!r}", file=sys.stderr)
        return 2
    watched = settings.watched(namespaces)
    import disagg.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=standalone,
        namespaces=watched,
        clusterwide=not watched,
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None,
        memo=kopf.Memo(settings=settings, namespaces=watched, standalone=standalone, kubeconfig=kubeconfig,
                       priority=settings.peering_priority()),
    )
    return 0


def run(args: argparse.Namespace) -> int:
    return run_operator(args.namespace, args.standalone, args.kubeconfig, args.liveness_port, args.verbose)


def main() -> int:
    p = argparse.ArgumentParser(prog="disagg operator", description="Run the DisaggCluster operator.")
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
