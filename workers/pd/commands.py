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

from disagg.proto import disagg_pd_pb2 as pb
from disagg.proto.vocabulary import DESCRIBE_METHOD, MAX_PORT, InstanceInfo

if TYPE_CHECKING:
    import grpc

    from disagg.workers.security.key import ClusterKey
    from disagg.workers.security.tls import TlsFiles


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.workers.args import add_key_arguments, positive

    p.add_argument("--decode", required=True, type=_host_port, metavar="HOST:GRPC", help="the decode's DisaggPDService")
    p.add_argument("--prefill", required=True, type=_host_port, metavar="HOST:GRPC",
                   help="the prefill's DisaggPDService")
    p.add_argument("--prefill-transfer-port", type=_port, default=None,
                   help="the prefill's --transfer-port (default: asked of the prefill)")
    p.add_argument("--decode-transfer-port", type=_port, default=None,
                   help="the decode's --transfer-port, for unlink (default: asked of the decode)")
    p.add_argument("--timeout", type=positive(float), default=15.0, help="deadline of each call, seconds")
    add_key_arguments(p)


async def _call(target: str, method: str, instance: str, transfer_port: int | None, timeout: float,
                key: ClusterKey | None, tls: TlsFiles | None) -> str | None:
    """One LinkInstance/UnlinkInstance on `target` with `instance`'s info, signed with `key`
    (over TLS with `tls`); the error, or None. Without `transfer_port`, `instance` is asked for it."""
    import grpc

    from disagg.proto import disagg_pd_pb2_grpc
    from disagg.workers.security.control import control_channel

    credentials = None if tls is None else tls.grpc_channel_credentials()
    try:
        message = await _payload(instance, transfer_port, method == "UnlinkInstance", timeout, key, credentials)
    except ValueError as exc:
        return str(exc)
    async with control_channel(target, key, tls=credentials) as channel:
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
        try:
            status = await getattr(stub, method)(message, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return f"{target} refused: {exc.code().name}: {exc.details()}"
    return None if status.ok else f"{target} answered ok=false"


async def _payload(instance: str, transfer_port: int | None, unlink: bool, timeout: float, key: ClusterKey | None,
                   credentials: grpc.ChannelCredentials | None) -> pb.InstanceClusterInfo:
    """`instance`'s info for a link call, its transfer port asked of it (DESCRIBE_METHOD) unless given.
    An unlink whose peer does not answer names the peer alone, which is enough to unlink (PROTOCOL.md).
    ValueError with the reason when there is no info to send."""
    import grpc

    from disagg.workers.security.control import control_channel

    instance = _by_ipv4(instance)  # the payload's cluster_id is made of an IPv4 address
    if transfer_port is None:
        try:
            async with control_channel(instance, key, tls=credentials) as channel:
                describe = channel.unary_unary(DESCRIBE_METHOD,
                                               request_serializer=pb.InstanceClusterInfo.SerializeToString,
                                               response_deserializer=pb.InstanceClusterInfo.FromString)
                described = InstanceInfo.from_proto(await describe(pb.InstanceClusterInfo(), timeout=timeout))
        except grpc.aio.AioRpcError as exc:
            if unlink:
                return pb.InstanceClusterInfo(instance_name=instance)
            raise ValueError(f"asking {instance} for its transfer port: {exc.code().name}: {exc.details()}") from exc
        transfer_port = int(described.transfer_address.rpartition(":")[2])
    return InstanceInfo(instance, f"{instance.rpartition(':')[0]}:{transfer_port}").to_proto()


def _port(text: str) -> int:
    """An argparse type: a port number, 1 to MAX_PORT."""
    if not (text.isdigit() and 0 < int(text) <= MAX_PORT):
        raise argparse.ArgumentTypeError(f"expected a port from 1 to {MAX_PORT}, got {text!r}")
    return int(text)


def _host_port(text: str) -> str:
    """An argparse type: HOST:PORT with a port number in range."""
    host, _, port = text.rpartition(":")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    _port(port)
    return text


def _by_ipv4(instance: str) -> str:
    """HOST:PORT with HOST resolved to its first IPv4 address (`localhost:7777` -> `127.0.0.1:7777`)."""
    host, _, port = instance.rpartition(":")
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{instance!r}: no IPv4 address for {host!r} ({exc})") from exc
    return f"{address}:{port}"


def link_call(decode: str, prefill: str, prefill_transfer_port: int | None, timeout: float,
              key: ClusterKey | None, tls: TlsFiles | None = None) -> str | None:
    """LinkInstance on the decode, payload = the prefill (its transfer port asked of it when None);
    the refusal's reason, or None."""
    return asyncio.run(_call(decode, "LinkInstance", prefill, prefill_transfer_port, timeout, key, tls))


def unlink_calls(decode: str, decode_transfer_port: int | None, prefill: str, prefill_transfer_port: int | None,
                 timeout: float, key: ClusterKey | None, tls: TlsFiles | None = None) -> list[str]:
    """UnlinkInstance on both sides at once; the errors, each naming its side."""

    async def both() -> list[str | None]:
        return list(await asyncio.gather(
            _call(decode, "UnlinkInstance", prefill, prefill_transfer_port, timeout, key, tls),
            _call(prefill, "UnlinkInstance", decode, decode_transfer_port, timeout, key, tls),
        ))

    return [error for error in asyncio.run(both()) if error]


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
        print(f"disagg link: {error}", file=sys.stderr)
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
