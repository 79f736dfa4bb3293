"""`disagg link` and `disagg unlink`: the operator's link calls, by hand.

`link_call` and `unlink_calls` are the calls themselves, shared with
`disagg demo` (disagg.workers.local).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from typing import TYPE_CHECKING

from disagg.proto.vocabulary import TRANSFER_PORT, InstanceInfo

if TYPE_CHECKING:
    from disagg.workers.security.key import ClusterKey
    from disagg.workers.security.tls import TlsFiles


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode", required=True, metavar="HOST:GRPC", help="the decode's DisaggPDService")
    p.add_argument("--prefill", required=True, metavar="HOST:GRPC", help="the prefill's DisaggPDService")
    p.add_argument("--prefill-transfer-port", type=int, default=TRANSFER_PORT,
                   help="the prefill's --transfer-port (default %(default)s)")
    p.add_argument("--decode-transfer-port", type=int, default=TRANSFER_PORT,
                   help="the decode's --transfer-port, for unlink (default %(default)s)")
    p.add_argument("--timeout", type=float, default=15.0, help="deadline of each call, seconds")
    from disagg.workers.args import add_key_arguments

    add_key_arguments(p)


async def _call(target: str, method: str, instance: str, transfer_port: int, timeout: float,
                key: ClusterKey | None, tls: TlsFiles | None) -> str | None:
    """One LinkInstance/UnlinkInstance on `target` with `instance`'s info, signed with `key`
    (over TLS with `tls`); the error, or None."""
    import grpc

    from disagg.proto import disagg_pd_pb2_grpc
    from disagg.workers.security.control import control_channel

    try:
        instance = _by_ipv4(instance)  # the payload's cluster_id is made of an IPv4 address
        message = InstanceInfo(instance, f"{instance.rpartition(':')[0]}:{transfer_port}").to_proto()
    except ValueError as exc:
        return str(exc)
    async with control_channel(target, key, tls=None if tls is None else tls.grpc_channel_credentials()) as channel:
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
        try:
            status = await getattr(stub, method)(message, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return None if status.ok else "answered ok=false"


def _by_ipv4(instance: str) -> str:
    """HOST:PORT with HOST resolved to its first IPv4 address (`localhost:7777` -> `127.0.0.1:7777`)."""
    host, _, port = instance.rpartition(":")
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{instance!r}: no IPv4 address for {host!r} ({exc})") from exc
    return f"{address}:{port}"


def link_call(decode: str, prefill: str, prefill_transfer_port: int, timeout: float,
              key: ClusterKey | None, tls: TlsFiles | None = None) -> str | None:
    """LinkInstance on the decode, payload = the prefill; the refusal's reason, or None."""
    return asyncio.run(_call(decode, "LinkInstance", prefill, prefill_transfer_port, timeout, key, tls))


def unlink_calls(decode: str, decode_transfer_port: int, prefill: str, prefill_transfer_port: int,
                 timeout: float, key: ClusterKey | None, tls: TlsFiles | None = None) -> list[str]:
    """UnlinkInstance on both sides at once; the errors, each naming its side."""

    async def both() -> list[str | None]:
        return list(await asyncio.gather(
            _call(decode, "UnlinkInstance", prefill, prefill_transfer_port, timeout, key, tls),
            _call(prefill, "UnlinkInstance", decode, decode_transfer_port, timeout, key, tls),
        ))

    answers = asyncio.run(both())
    return [f"{side}: {error}" for side, error in zip((decode, prefill), answers) if error]


def _credentials(args: argparse.Namespace, command: str) -> tuple[ClusterKey | None, TlsFiles | None, int]:
    """The key of --cluster-key-file (None with --insecure) and the TLS files of --tls-dir,
    or the exit code of a clear error."""
    from disagg.workers.args import cluster_key, tls_files

    try:
        return cluster_key(args), tls_files(args), 0
    except ValueError as exc:
        print(f"disagg {command}: {exc}", file=sys.stderr)
        return None, None, 2


def run_link(args: argparse.Namespace) -> int:
    key, tls, code = _credentials(args, "link")
    if code:
        return code
    error = link_call(args.decode, args.prefill, args.prefill_transfer_port, args.timeout, key, tls)
    if error:
        print(f"disagg link: {args.decode} refused: {error}", file=sys.stderr)
        return 1
    print(f"linked decode {args.decode} to prefill {args.prefill}")
    return 0


def run_unlink(args: argparse.Namespace) -> int:
    key, tls, code = _credentials(args, "unlink")
    if code:
        return code
    errors = unlink_calls(args.decode, args.decode_transfer_port, args.prefill, args.prefill_transfer_port,
                          args.timeout, key, tls)
    for error in errors:
        print(f"disagg unlink: {error}", file=sys.stderr)
    if not errors:
        print(f"unlinked decode {args.decode} from prefill {args.prefill}")
    return 1 if errors else 0
