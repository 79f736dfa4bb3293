"""`disagg link` and `disagg unlink`: the operator's link calls, by hand.

Register in workers/cli.py's SUBCOMMANDS:
    "link": (LINK_HELP, add_link_arguments, run_link),
    "unlink": (UNLINK_HELP, add_link_arguments, run_unlink),
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from disagg.proto import disagg_pd_pb2_grpc
from disagg.workers.pd.links import InstanceInfo

LINK_HELP = "Link a decode to a prefill (LinkInstance on the decode, payload = the prefill)."
UNLINK_HELP = "Unlink a decode from a prefill (UnlinkInstance on both sides)."


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode", required=True, metavar="HOST:GRPC", help="the decode's DisaggPDService")
    p.add_argument("--prefill", required=True, metavar="HOST:GRPC", help="the prefill's DisaggPDService")
    p.add_argument("--prefill-transfer-port", type=int, default=26000,
                   help="the prefill's --transfer-port (default %(default)s)")
    p.add_argument("--decode-transfer-port", type=int, default=26000,
                   help="the decode's --transfer-port, for unlink (default %(default)s)")
    p.add_argument("--timeout", type=float, default=15.0, help="deadline of each call, seconds")


def _info(address: str, transfer_port: int) -> InstanceInfo:
    host = address.rpartition(":")[0]
    return InstanceInfo(address, f"{host}:{transfer_port}")


async def _call(target: str, method: str, info: InstanceInfo, timeout: float) -> str | None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
        try:
            status = await getattr(stub, method)(info.to_proto(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return None if status.ok else "answered ok=false"


def run_link(args: argparse.Namespace) -> int:
    error = asyncio.run(_call(args.decode, "LinkInstance", _info(args.prefill, args.prefill_transfer_port),
                              args.timeout))  # fmt: skip
    if error:
        print(f"disagg link: {args.decode} refused: {error}", file=sys.stderr)
        return 1
    print(f"linked decode {args.decode} to prefill {args.prefill}")
    return 0


def run_unlink(args: argparse.Namespace) -> int:
    async def both() -> list[str | None]:
        return list(await asyncio.gather(
            _call(args.decode, "UnlinkInstance", _info(args.prefill, args.prefill_transfer_port), args.timeout),
            _call(args.prefill, "UnlinkInstance", _info(args.decode, args.decode_transfer_port), args.timeout),
        ))  # fmt: skip

    errors = [e for e in asyncio.run(both()) if e]
    for error in errors:
        print(f"disagg unlink: {error}", file=sys.stderr)
    if not errors:
        print(f"unlinked decode {args.decode} from prefill {args.prefill}")
    return 1 if errors else 0
