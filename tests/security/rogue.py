"""A rogue on the same network: tries the worker's control and data paths
with no key, another key, or a stale credential of the right one, and prints
one JSON object: attempt -> the gRPC status name or the transfer refusal.

    python rogue.py --decode D_GRPC --prefill P_GRPC --prefill-transfer P_XFER
                    --decode-transfer D_XFER --decode-name NAME [--key-file PATH] [--stale-key-file PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import grpc
import torch

from disagg.proto import disagg_pd_pb2 as pb, disagg_pd_pb2_grpc
from disagg.workers.security.control import METADATA_KEY, control_channel
from disagg.workers.security.key import ClusterKey
from disagg.workers.transfer import KVLayout, TransferError, create_transport

ADD = "/xllm.proto.DisaggPDService/AddNewRequests"


async def _status(call: Any) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return str(err.code().name)
    return "OK"


async def control(args: argparse.Namespace, key: ClusterKey | None) -> dict[str, str]:
    me = "127.0.0.1:1"
    request = pb.DisaggRequests(prefill_name=me, reqs=[pb.DisaggRequest(req_id="rogue", prompt_tokens=[5, 6, 7])])
    # A body near the workers' 16 MiB limit: refused without being taken in (security/control.py).
    big = pb.DisaggRequests(prefill_name=me, reqs=[pb.DisaggRequest(req_id="rogue", prompt_tokens=[5] * (15 << 20))])
    async with control_channel(args.decode, key, [("grpc.max_send_message_length", 64 << 20)]) as decode, \
            control_channel(args.prefill, key) as prefill:
        decode_stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(decode)
        results = {
            "link": await _status(decode_stub.LinkInstance(
                pb.InstanceClusterInfo(instance_name=me, addrs=[args.prefill_transfer]), timeout=10)),
            "add_requests": await _status(decode_stub.AddNewRequests(request, timeout=10)),
            "big_add_requests": await _status(decode_stub.AddNewRequests(big, timeout=30)),
            "unlink": await _status(disagg_pd_pb2_grpc.DisaggPDServiceStub(prefill).UnlinkInstance(
                pb.InstanceClusterInfo(instance_name=args.decode_name), timeout=10)),
        }
        if args.stale_key_file:  # a credential of the right key, replayed after its window
            stale = ClusterKey.from_file(args.stale_key_file).credential(ADD, now=time.time() - 600)
            results["stale_add_requests"] = await _status(
                decode_stub.AddNewRequests(request, metadata=((METADATA_KEY, stale),), timeout=10))
    return results


def transfer(args: argparse.Namespace, key: ClusterKey | None) -> dict[str, str]:
    """A data-path link to each side: the prefill (to pull its KV, posing as its decode) and the decode
    (to push, posing as another worker: named as the decode, our own transport would not even ask)."""
    results = {}
    for attempt, address, name in (("pull_kv", args.prefill_transfer, args.decode_name),
                                   ("push_kv", args.decode_transfer, "127.0.0.1:1")):
        # The handshake is refused before any layout is revealed, so a guessed one is all it can send.
        layout = KVLayout("guess", "float32", 1, 1, 1, 1, 1)
        rogue = create_transport("tcp", torch.zeros(layout.shape), layout, name, name, num_connections=1, key=key)
        try:
            rogue.connect(address, timeout=10)
            results[attempt] = "linked"
        except TransferError as exc:
            results[attempt] = str(exc)
        finally:
            rogue.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("--decode", "--prefill", "--prefill-transfer", "--decode-transfer", "--decode-name"):
        parser.add_argument(name, required=True)
    parser.add_argument("--key-file", help="a key to sign with (default: none)")
    parser.add_argument("--stale-key-file", help="the real key, to replay a credential outside its window")
    args = parser.parse_args()
    key = ClusterKey.from_file(args.key_file) if args.key_file else None
    results = asyncio.run(control(args, key))
    results.update(transfer(args, key))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
