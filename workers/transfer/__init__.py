"""The KV transfer engine: one interface (`base.py`), transports chosen by name.

`TRANSPORTS` registers one class per name of `disagg.proto.vocabulary.Transport`,
the torch-free list that `--kv-transport` and the CRD offer (a test keeps the two equal).
"""

from __future__ import annotations

from typing import Any

import torch

from disagg.workers.transfer.access import Access, BlockAccess, revoke_settled
from disagg.workers.transfer.base import (
    KVLayout,
    KVTransport,
    LinkRefusedError,
    PeerInfo,
    TransferError,
    TransferHandle,
    TransferSession,
    TransferTimeout,
)
from disagg.workers.transfer.cuda_ipc import CudaIpcTransport
from disagg.workers.transfer.nccl import NcclTransport
from disagg.workers.transfer.tcp import TcpTransport

# cuda_ipc and nccl refuse a CPU pool with a ValueError at construction.
TRANSPORTS: dict[str, type[KVTransport]] = {
    TcpTransport.name: TcpTransport,
    CudaIpcTransport.name: CudaIpcTransport,
    NcclTransport.name: NcclTransport,
}


def create_transport(
    name: str, pool: torch.Tensor, layout: KVLayout, instance_name: str, grpc_address: str, **options: Any
) -> KVTransport:
    """Build the transport registered as `name` over `pool` (not started yet).

    Args:
        options: passed to the transport, e.g. `num_connections`, `io_timeout`.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](pool, layout, instance_name, grpc_address, **options)


__all__ = [
    "TRANSPORTS",
    "Access",
    "BlockAccess",
    "KVLayout",
    "KVTransport",
    "LinkRefusedError",
    "PeerInfo",
    "TransferError",
    "TransferHandle",
    "TransferSession",
    "TransferTimeout",
    "create_transport",
    "revoke_settled",
]
