"""Byte-level access to a KV pool for socket transports.

A CPU pool is sent from and received into directly (memoryviews of the
tensor's memory: no copy in Python). A CUDA pool goes through a pinned host
staging buffer, chunk by chunk, on a side stream.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Sequence

import torch

from disagg.workers.transfer.base import KVLayout
from disagg.workers.transfer.wire import Hasher, recv_into_exact

# Bytes hashed and sent per step: small enough to stay in cache between the
# hash and the send, large enough to keep Python overhead low.
CHUNK_BYTES = 1 << 20
STAGING_BYTES = 8 << 20


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory.

    NOTE: the view does not keep the tensor alive; the caller must.
    """
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "host_view needs a contiguous CPU tensor"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class PoolIO:
    """Streams (layer, block, count) segments of one pool to and from a socket.

    One per connection: the staging buffer and stream of a CUDA pool are not shared.
    """

    def __init__(self, pool: torch.Tensor, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self.is_cuda = pool.device.type == "cuda"
        if self.is_cuda:
            self._flat = pool.view(torch.uint8).reshape(-1)  # [pool_bytes] on the device
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            self._staging_view = host_view(self._staging)
            self._stream = torch.cuda.Stream(device=pool.device)
        else:
            self._view = host_view(pool)

    def _span(self, segment: tuple[int, int, int]) -> tuple[int, int]:
        layer, block, count = segment
        return self.layout.block_offset(layer, block), count * self.layout.block_bytes

    def send(
        self,
        sock: socket.socket,
        segments: Sequence[tuple[int, int, int]],
        hasher: Hasher,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Send the segments' bytes in order, feeding `hasher` with exactly what was sent.

        Args:
            ready: for a CUDA pool, an event after which the blocks hold their final values.
        """
        if self.is_cuda and ready is not None:
            self._stream.wait_event(ready)
        for segment in segments:
            offset, size = self._span(segment)
            step = STAGING_BYTES if self.is_cuda else CHUNK_BYTES
            for start in range(offset, offset + size, step):
                view = self._host_chunk(start, min(step, offset + size - start))
                hasher.update(view)
                sock.sendall(view)

    def recv(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]], hasher: Hasher) -> None:
        """Receive the segments' bytes in order straight into the pool (or via staging)."""
        for segment in segments:
            offset, size = self._span(segment)
            if not self.is_cuda:
                recv_into_exact(sock, self._view[offset : offset + size], hasher)
                continue
            for start in range(offset, offset + size, STAGING_BYTES):
                n = min(STAGING_BYTES, offset + size - start)
                recv_into_exact(sock, self._staging_view[:n], hasher)
                with torch.cuda.stream(self._stream):
                    self._flat[start : start + n].copy_(self._staging[:n], non_blocking=True)
                # NOTE: the staging buffer is reused by the next chunk, and the
                # ACK promises the bytes are in the pool: wait for the copy.
                self._stream.synchronize()

    def _host_chunk(self, start: int, size: int) -> memoryview:
        if not self.is_cuda:
            return self._view[start : start + size]
        with torch.cuda.stream(self._stream):
            self._staging[:size].copy_(self._flat[start : start + size], non_blocking=True)
        self._stream.synchronize()
        return self._staging_view[:size]
