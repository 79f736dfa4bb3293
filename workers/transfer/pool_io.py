"""Byte-level access to a KV pool for socket transports.

A CPU pool is sent from and received into directly: memoryviews of the
tensor's memory, gathered into one `sendmsg` and scattered by one
`recvmsg_into` per batch (no copy in Python, no per-block system call). A
CUDA pool goes through two pinned host staging buffers on a side stream, so
that the device copy of one batch overlaps the socket I/O of the other.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Iterator, Sequence

import torch

from disagg.workers.transfer.base import KVLayout
from disagg.workers.transfer.wire import Hasher, recv_into_views, send_views

# Bytes hashed and moved per system call on a CPU pool: small enough that the
# bytes just hashed are still in the L2 cache when the kernel copies them (and
# vice versa on receive), large enough that Python's per-call cost vanishes.
BATCH_BYTES = 1 << 20
# Each of the two pinned staging buffers of a CUDA pool.
STAGING_BYTES = 4 << 20

Span = tuple[int, int]  # (byte offset in the pool, byte count)


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory.

    NOTE: the view does not keep the tensor alive; the caller must.
    """
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "host_view needs a contiguous CPU tensor"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def batches(spans: Sequence[Span], limit: int) -> Iterator[list[Span]]:
    """Group spans, in order, into batches of at most `limit` bytes, cutting spans that straddle."""
    assert limit > 0, f"batch limit must be positive, got {limit}"
    batch: list[Span] = []
    room = limit
    for offset, size in spans:
        while size:
            take = min(size, room)
            batch.append((offset, take))
            offset, size, room = offset + take, size - take, room - take
            if room == 0:
                yield batch
                batch, room = [], limit
    if batch:
        yield batch


class PoolIO:
    """Streams (layer, block, count) segments of one pool to and from a socket.

    One per connection: the staging buffers and stream of a CUDA pool are not shared.
    """

    def __init__(self, pool: torch.Tensor, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self.is_cuda = pool.device.type == "cuda"
        # KVLayout's byte sizes are properties (about 0.5 us a call); frames need
        # them per segment, so they are computed once here.
        self._block_bytes = layout.block_bytes
        self._layer_bytes = layout.layer_bytes
        if self.is_cuda:
            self._flat = pool.view(torch.uint8).reshape(-1)  # [pool_bytes] on the device
            self._staging = torch.empty((2, STAGING_BYTES), dtype=torch.uint8, pin_memory=True)
            self._staging_views = [host_view(self._staging[half]) for half in range(2)]
            self._stream = torch.cuda.Stream(device=pool.device)
        else:
            self._view = host_view(pool)

    def spans(self, segments: Sequence[tuple[int, int, int]]) -> list[Span]:
        """Byte spans of the segments in wire order, neighbours in memory merged."""
        spans: list[Span] = []
        for layer, block, count in segments:
            offset, size = layer * self._layer_bytes + block * self._block_bytes, count * self._block_bytes
            if spans and spans[-1][0] + spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], spans[-1][1] + size)
            else:
                spans.append((offset, size))
        return spans

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
        if self.is_cuda:
            self._send_staged(sock, self.spans(segments), hasher, ready)
            return
        for batch in batches(self.spans(segments), BATCH_BYTES):
            views = [self._view[offset : offset + size] for offset, size in batch]
            send_views(sock, views)
            for view in views:
                hasher.update(view)

    def recv(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]], hasher: Hasher) -> None:
        """Receive the segments' bytes in order straight into the pool (or via staging)."""
        if self.is_cuda:
            self._recv_staged(sock, self.spans(segments), hasher)
            return
        for batch in batches(self.spans(segments), BATCH_BYTES):
            views = [self._view[offset : offset + size] for offset, size in batch]
            recv_into_views(sock, views)
            for view in views:
                hasher.update(view)

    def discard(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]]) -> None:
        """Read and drop the segments' bytes (a refused frame's payload)."""
        size = sum(count for _, _, count in segments) * self._block_bytes
        scratch = memoryview(bytearray(min(size, BATCH_BYTES)))
        while size > 0:
            take = min(size, len(scratch))
            recv_into_views(sock, [scratch[:take]])
            size -= take

    # ---- CUDA pools: double-buffered pinned staging ----------------------------

    def _send_staged(self, sock: socket.socket, spans: list[Span], hasher: Hasher,
                     ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            self._stream.wait_event(ready)
        queued: tuple[torch.cuda.Event, int, int] | None = None  # (copied, half, bytes) not sent yet
        for index, batch in enumerate(batches(spans, STAGING_BYTES)):
            half = index % 2
            # NOTE: this half was last sent two batches ago; sendmsg returned, so the kernel holds those bytes.
            filled = self._copy_batch(batch, half, to_device=False)
            if queued is not None:
                self._send_half(sock, hasher, *queued)
            queued = (filled, half, sum(size for _, size in batch))
        if queued is not None:
            self._send_half(sock, hasher, *queued)

    def _send_half(self, sock: socket.socket, hasher: Hasher, copied: torch.cuda.Event, half: int,
                   nbytes: int) -> None:
        copied.synchronize()
        view = self._staging_views[half][:nbytes]
        hasher.update(view)
        send_views(sock, [view])

    def _recv_staged(self, sock: socket.socket, spans: list[Span], hasher: Hasher) -> None:
        drained: list[torch.cuda.Event | None] = [None, None]  # per half: its last copy to the device
        for index, batch in enumerate(batches(spans, STAGING_BYTES)):
            half = index % 2
            if (previous := drained[half]) is not None:
                previous.synchronize()  # the device has read this half's previous bytes
            view = self._staging_views[half][: sum(size for _, size in batch)]
            recv_into_views(sock, [view])
            hasher.update(view)
            drained[half] = self._copy_batch(batch, half, to_device=True)
        # NOTE: the ACK promises the bytes are in the pool: wait for the last copies.
        self._stream.synchronize()

    def _copy_batch(self, batch: list[Span], half: int, to_device: bool) -> torch.cuda.Event:
        """Queue the copies between a batch's pool spans and one staging half; the event marks their end."""
        staging = self._staging[half]  # [STAGING_BYTES] pinned
        position = 0
        with torch.cuda.stream(self._stream):
            for offset, size in batch:
                host, device = staging[position : position + size], self._flat[offset : offset + size]
                (device if to_device else host).copy_(host if to_device else device, non_blocking=True)
                position += size
        return self._stream.record_event()
