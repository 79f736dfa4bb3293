"""A transfer peer in its own process, driven by line commands on stdin.

    python peer.py listen  --layout JSON --name NAME [--seed N] [--connections N] [--transport T] [--device D]
    python peer.py connect --layout JSON --name NAME --address HOST:PORT [same options]

Prints "ready HOST:PORT" (listen) or "linked PEER" (connect), then obeys
"dump PATH" (save the pool, answer "dumped") and "quit".

`--transport gloo` is the `nccl` transport with its communicator made by Gloo
on CPU pools: the same handshake rendezvous and frame-ordered payload, on a
machine without GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from disagg.workers.transfer import KVLayout, KVTransport, create_transport
from disagg.workers.transfer.nccl import NcclTransport


class GlooPairTransport(NcclTransport):
    """NcclTransport whose pair communicator is Gloo's, over loopback only, for CPU pools."""

    name = "gloo"

    @staticmethod
    def _check_pool(pool: torch.Tensor) -> None:
        if pool.device.type != "cpu":
            raise ValueError("the gloo test transport moves CPU pools")

    def _process_group(self, store: dist.Store, rank: int) -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timedelta(seconds=self.io_timeout)
        return dist.ProcessGroupGloo(store, rank, 2, options)


def make_transport(name: str, pool: torch.Tensor, layout: KVLayout, instance: str, **options: Any) -> KVTransport:
    """A registered transport by name, or the Gloo stand-in for nccl."""
    if name == GlooPairTransport.name:
        return GlooPairTransport(pool, layout, instance, instance, **options)
    return create_transport(name, pool, layout, instance, instance, **options)


def seeded_pool(layout: KVLayout, seed: int) -> torch.Tensor:
    """The pool a peer with `seed` starts with (seed 0: all zeros)."""
    if seed == 0:
        return torch.zeros(layout.shape, dtype=layout.torch_dtype)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=generator).to(layout.torch_dtype)


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["listen", "connect"])
    parser.add_argument("--layout", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--address", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--connections", type=int, default=2)
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    layout = KVLayout.from_dict(json.loads(args.layout))
    pool = seeded_pool(layout, args.seed).to(args.device)
    transport = make_transport(args.transport, pool, layout, args.name, num_connections=args.connections)
    if args.mode == "listen":
        print("ready", transport.start("127.0.0.1", 0), flush=True)
    else:
        session = transport.connect(args.address, timeout=10.0)
        print("linked", session.peer.name, flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "dump":
            torch.save(pool.cpu(), arg)
            print("dumped", flush=True)
        elif command == "quit":
            break
    transport.close()


if __name__ == "__main__":
    main()
