"""The `nccl` transport: KV bytes over one NCCL communicator per linked pair.

The link handshake sets the communicator up: the accepting side (the
prefill, rank 0) hosts a small TCPStore for it and names its port in the
REPLY; the connecting side (the decode) is rank 1. Frames still travel on the
one TCP connection of the link (`wire.py`), so both sides post their NCCL
sends and receives in frame order; only the payload moves through NCCL, from
and into the pool's device memory. No checksum: NCCL checks its own
transport, and the frame header still checks sizes.

The rendezvous and the frame-ordered payload only need a torch process group
with point-to-point send and recv; `_process_group` is the one place that
names NCCL (the tests run the same path over Gloo on CPU pools).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from disagg.workers.transfer.base import KVLayout, TransferError
from disagg.workers.transfer.handshake import Hello
from disagg.workers.transfer.tcp import PayloadIO, TcpTransport
from disagg.workers.transfer.wire import ChecksumKind, Hasher

_ACCEPTOR_RANK = 0
_INITIATOR_RANK = 1


class CollectivePayload:
    """Moves frame payloads with point-to-point send/recv on the pair's process group."""

    def __init__(self, pool: torch.Tensor, layout: KVLayout, group: Any, peer_rank: int) -> None:
        self.layout = layout
        self._flat = pool.view(torch.uint8).reshape(-1)  # [pool_bytes] on the pool's device
        self._group = group
        self._peer_rank = peer_rank
        # A side stream keeps NCCL's kernels off the forward's stream; CPU groups need none.
        self._stream = torch.cuda.Stream(device=pool.device) if pool.is_cuda else None
        # NOTE: calls on one communicator must not interleave between threads.
        self._lock = threading.Lock()

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _views(self, segments: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        spans = [(self.layout.block_offset(layer, block), count * self.layout.block_bytes)
                 for layer, block, count in segments]
        return [self._flat[offset : offset + size] for offset, size in spans]

    def send(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]], hasher: Hasher,
             ready: torch.cuda.Event | None = None) -> None:
        with self._lock, self._on_stream():
            if ready is not None and self._stream is not None:
                self._stream.wait_event(ready)
            for view in self._views(segments):
                self._group.send([view], self._peer_rank, 0).wait()
            self._synchronize()

    def recv(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]], hasher: Hasher) -> None:
        with self._lock, self._on_stream():
            for view in self._views(segments):
                self._group.recv([view], self._peer_rank, 0).wait()
            self._synchronize()

    def discard(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]]) -> None:
        # The sender still posts one send per segment: match each with a receive of its size.
        block_bytes = self.layout.block_bytes
        with self._lock, self._on_stream():
            for _, _, count in segments:
                scratch = torch.empty(count * block_bytes, dtype=torch.uint8, device=self._flat.device)
                self._group.recv([scratch], self._peer_rank, 0).wait()
            self._synchronize()


class NcclTransport(TcpTransport):
    """Cross-node links over NCCL, set up through the link handshake."""

    name = "nccl"

    def __init__(self, pool: torch.Tensor, layout: KVLayout, instance_name: str, grpc_address: str,
                 **options: Any) -> None:
        self._check_pool(pool)
        options.update(num_connections=1, checksums=[ChecksumKind.NONE])  # frame order = NCCL op order
        super().__init__(pool, layout, instance_name, grpc_address, **options)
        self._stores: dict[str, dist.TCPStore] = {}

    @staticmethod
    def _check_pool(pool: torch.Tensor) -> None:
        """Raise ValueError when this transport's backend cannot move `pool`."""
        if pool.device.type != "cuda" or not dist.is_nccl_available():
            raise ValueError("the nccl transport needs a KV pool on a CUDA device and a torch built with NCCL")

    def _process_group(self, store: dist.Store, rank: int) -> Any:
        """The pair's two-rank communicator over the rendezvous `store`.

        Returns a torch process-group backend (`Any`: torch's stubs give those no send/recv).
        """
        return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())

    def _hello_extras(self) -> dict[str, Any]:
        return {"nccl_group": uuid.uuid4().hex}

    def _accept_extras(self, hello: Hello) -> dict[str, Any]:
        group = hello.extras.get("nccl_group")
        if not isinstance(group, str) or not group or group in self._stores:
            raise TransferError(f"nccl HELLO with a bad group {group!r}")
        host = "0.0.0.0"  # the peer reaches the store at the address it reached us on
        try:
            store = dist.TCPStore(host, 0, 2, True, timedelta(seconds=self.io_timeout), wait_for_workers=False)
        except RuntimeError as exc:
            raise TransferError(f"cannot host the NCCL rendezvous store: {exc}") from exc
        self._stores[group] = store
        return {"nccl_group": group, "nccl_store_port": store.port}

    def _payloads(self, socks: list[socket.socket], extras: dict[str, Any], initiator: bool) -> list[PayloadIO]:
        assert len(socks) == 1, "nccl links use one frame connection"
        group = str(extras["nccl_group"])  # the initiator's HELLO named it; the REPLY echoes it
        if initiator:
            host = socks[0].getpeername()[0]
            store = dist.TCPStore(host, int(extras["nccl_store_port"]), 2, False, timedelta(seconds=self.io_timeout))
        else:
            store = self._stores.pop(group)
        rank = _INITIATOR_RANK if initiator else _ACCEPTOR_RANK
        process_group = self._process_group(dist.PrefixStore(group, store), rank)
        return [CollectivePayload(self.pool, self.layout, process_group, 1 - rank)]
