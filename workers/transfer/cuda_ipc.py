"""The `cuda_ipc` transport: same node, device-to-device copies into the peer's pool.

Each side exports its pool once in the handshake (torch's CUDA IPC handle,
sent as plain fields, never pickled code); the other side opens it once and
copies blocks with `copy_` on a side stream. The TCP connection of the link
stays open only to notice a peer that goes away. No checksum: the bytes never
leave the GPU, and the handshake checked both layouts.
"""

from __future__ import annotations

import base64
import queue
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from disagg.workers.transfer.base import (
    KVLayout,
    PeerInfo,
    PendingTransfers,
    TransferError,
    TransferHandle,
    TransferSession,
    check_runs,
    merge_runs,
)
from disagg.workers.transfer.handshake import Hello
from disagg.workers.transfer.link import LinkedTransport


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


def export_pool(pool: torch.Tensor) -> dict[str, Any]:
    """JSON-safe CUDA IPC description of `pool`."""
    _, (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, _,
        ref_handle, ref_offset, event_handle, event_sync) = reduce_tensor(pool)
    return {
        "size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).removeprefix("torch."),
        "device": device, "handle": _b64(handle), "storage_bytes": storage_bytes,
        "storage_offset": storage_offset, "ref_handle": _b64(ref_handle), "ref_offset": ref_offset,
        "event_handle": _b64(event_handle), "event_sync": event_sync,
    }


def open_pool(exported: dict[str, Any], layout: KVLayout) -> torch.Tensor:
    """Map a peer's exported pool into this process and check it has `layout`."""
    try:
        pool = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(exported["size"]), tuple(exported["stride"]), int(exported["offset"]),
            torch.storage.TypedStorage, getattr(torch, exported["dtype"]), int(exported["device"]),
            _unb64(exported["handle"]), int(exported["storage_bytes"]), int(exported["storage_offset"]), False,
            _unb64(exported["ref_handle"]), int(exported["ref_offset"]), _unb64(exported["event_handle"]),
            bool(exported["event_sync"]),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise TransferError(f"cannot open the peer's CUDA IPC pool: {exc}") from exc
    layout.check_pool(pool)
    return pool


class CudaIpcSession(TransferSession):
    """Copies between our pool and the peer's mapped pool on one side stream."""

    def __init__(self, peer: PeerInfo, local: torch.Tensor, remote: torch.Tensor, layout: KVLayout,
                 control: socket.socket) -> None:
        self.peer = peer
        self.layout = layout
        self._local = local
        self._remote = remote
        self._control = control
        self._stream = torch.cuda.Stream(device=local.device)
        self._pending = PendingTransfers()
        self._done: queue.SimpleQueue[tuple[torch.cuda.Event, TransferHandle] | None] = queue.SimpleQueue()
        self._open = True
        threading.Thread(target=self._complete_loop, name="ipc-complete", daemon=True).start()
        threading.Thread(target=self._watch_peer, name="ipc-watch", daemon=True).start()

    def push(self, layer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> TransferHandle:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range ({self.layout.num_layers} layers)")
        runs = merge_runs(src_blocks, dst_blocks)
        check_runs(runs, self.layout.num_blocks, self.peer.layout.num_blocks)
        pairs = [(self._remote[layer, r.dst : r.dst + r.count], self._local[layer, r.src : r.src + r.count])
                 for r in runs]
        return self._copy(pairs, len(src_blocks))

    def pull(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> TransferHandle:
        runs = merge_runs(src_blocks, dst_blocks)
        check_runs(runs, self.peer.layout.num_blocks, self.layout.num_blocks)
        # [:, a:b] spans every layer: one strided copy per run
        pairs = [(self._local[:, r.dst : r.dst + r.count], self._remote[:, r.src : r.src + r.count]) for r in runs]
        return self._copy(pairs, len(src_blocks) * self.layout.num_layers)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], blocks: int) -> TransferHandle:
        handle = TransferHandle(1, blocks * self.layout.block_bytes)
        if not self._open:
            handle.part_done(f"link to {self.peer.name} is closed")
            return handle
        # The copies wait for the work queued so far (the forward that wrote the blocks).
        self._stream.wait_stream(torch.cuda.current_stream(self._local.device))
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._done.put((event, handle))
        self._pending.add(handle)
        return handle

    def _complete_loop(self) -> None:
        while (item := self._done.get()) is not None:
            event, handle = item
            event.synchronize()
            handle.part_done(None if self._open else f"link to {self.peer.name} closed during the copy")

    def _watch_peer(self) -> None:
        try:
            self._control.settimeout(None)
            self._control.recv(1)  # the peer never sends after the handshake: any return is a close
        except OSError:
            pass
        self.close()

    def flush(self, timeout: float) -> None:
        self._pending.wait_all(timeout, self.peer.name)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._done.put(None)
        try:
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already disconnected
        self._control.close()

    @property
    def is_open(self) -> bool:
        return self._open


class CudaIpcTransport(LinkedTransport):
    """Same-node links: the peer's pool is mapped once and filled device to device."""

    name = "cuda_ipc"

    def __init__(self, pool: torch.Tensor, layout: KVLayout, instance_name: str, grpc_address: str,
                 **options: Any) -> None:
        if pool.device.type != "cuda":
            raise ValueError("the cuda_ipc transport needs a KV pool on a CUDA device")
        options["num_connections"] = 1  # the connection only carries the handshake
        super().__init__(pool, layout, instance_name, grpc_address, **options)

    def _hello_extras(self) -> dict[str, Any]:
        return {"ipc": export_pool(self.pool)}

    def _accept_extras(self, hello: Hello) -> dict[str, Any]:
        if "ipc" not in hello.extras:
            raise TransferError("cuda_ipc HELLO without an exported pool")
        return {"ipc": export_pool(self.pool)}

    def _open_session(self, peer: PeerInfo, socks: list[socket.socket], checksum: int,
                      extras: dict[str, Any], initiator: bool) -> TransferSession:
        assert len(socks) == 1, "cuda_ipc links use one control connection"
        remote = open_pool(extras["ipc"], peer.layout)
        return CudaIpcSession(peer, self.pool, remote, self.layout, socks[0])
