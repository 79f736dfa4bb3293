"""The `tcp` transport: KV blocks over several TCP connections per peer.

Each connection has a sender thread (the only writer of its socket) and a
reader thread (the only reader). Readers never send: answers (ACK, ERROR,
DATA) are queued to the sender, so two peers streaming at each other cannot
deadlock on full socket buffers. Frames are described in `wire.py`; layers
pushed faster than the socket drains leave as one frame (`send_queue.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from disagg.workers.transfer.access import Access, BlockAccess
from disagg.workers.transfer.base import (
    BlockRun,
    KVLayout,
    PeerInfo,
    PendingTransfers,
    TransferHandle,
    TransferSession,
    plan_runs,
)
from disagg.workers.transfer.link import LinkedTransport
from disagg.workers.transfer.pool_io import PoolIO
from disagg.workers.transfer.send_queue import LayerWrite, SendQueue
from disagg.workers.transfer.wire import (
    TRAILER,
    ChecksumKind,
    Frame,
    FrameError,
    Hasher,
    Kind,
    control_frame,
    encode_frame,
    frame_blocks,
    new_hasher,
    payload_segments,
    range_error,
    recv_exact,
    recv_frame,
)

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
_IDLE_POLL_S = 0.5  # how often an idle reader looks at the closed flag
# After telling a peer why it is cut off, its further bytes are read and dropped before the socket
# closes (see _close_after_telling): until it has been quiet this long, for at most the linger.
_TELLING_QUIET_S = 0.25
_TELLING_LINGER_S = 2.0
# Answers (ACK, ERROR, DATA) the reader may have queued for the sender at once. Our own peers
# keep a few per request in flight; a peer that asks far faster than it reads its answers
# (a flood of READs) is cut off here instead of growing the queue without end.
MAX_WAITING_ANSWERS = 1024


def tune_socket(sock: socket.socket, io_timeout: float) -> None:
    """Make a handshaken socket ready for bulk frames, every wait still bounded by `io_timeout`.

    The socket goes to blocking mode with the kernel's SO_RCVTIMEO/SO_SNDTIMEO
    as the bound: then one `sendmsg` queues a whole batch and one MSG_WAITALL
    `recvmsg_into` fills one, where Python's timeout mode would poll and return
    after every packet. NODELAY lets small frames (ACK, READ) leave at once.
    """
    assert io_timeout > 0, f"io_timeout must be positive, got {io_timeout}"
    sock.settimeout(None)
    seconds = int(io_timeout)
    timeval = struct.pack("@ll", seconds, int((io_timeout - seconds) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


class PayloadIO(Protocol):
    """Moves the KV bytes of a frame: over the socket (PoolIO) or a side channel (NCCL)."""

    def send(
        self, sock: socket.socket, segments: Sequence[tuple[int, int, int]], hasher: Hasher,
        ready: torch.cuda.Event | None = None,
    ) -> None: ...

    def recv(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]], hasher: Hasher) -> None: ...

    def discard(self, sock: socket.socket, segments: Sequence[tuple[int, int, int]]) -> None:
        """Consume the payload of a refused frame without storing it, keeping the link in step."""


def drop_until_quiet(sock: socket.socket, deadline: float) -> None:
    """Read and drop what the peer sends until it is quiet for _TELLING_QUIET_S, it closes, or
    `deadline` (monotonic) passes. Returns as soon as the socket is closed, also when another
    thread closes it meanwhile (a session closing: select refuses the closed socket's fd, -1,
    with ValueError)."""
    try:
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([sock], [], [], min(left, _TELLING_QUIET_S))
            if not readable or not sock.recv(1 << 16):
                return
    except (OSError, ValueError):
        return


class _Connection:
    """One socket of a session, with its reader and sender threads."""

    def __init__(
        self, sock: socket.socket, payload: PayloadIO, layout: KVLayout, peer: PeerInfo,
        checksum: ChecksumKind, io_timeout: float, on_broken: Callable[[str], None], access: BlockAccess,
    ) -> None:
        self.sock = sock
        self.access = access
        self.payload = payload
        self.layout = layout
        self.peer = peer
        self.checksum = checksum
        self.block_bytes = layout.block_bytes  # once: a KVLayout property, needed per segment
        self.bytes_sent = 0
        self.bytes_received = 0
        self._on_broken = on_broken
        self._jobs = SendQueue()
        # request id -> (handle, the READ frame for pulls or None for writes)
        self._pending: dict[int, tuple[TransferHandle, Frame | None]] = {}
        # request id of a merged WRITE frame -> the ids of its later layers, answered by its ACK
        self._merged: dict[int, list[int]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._waiting_answers = 0
        tune_socket(sock, io_timeout)
        self._threads = [
            threading.Thread(target=self._send_loop, name="kv-send", daemon=True),
            threading.Thread(target=self._read_loop, name="kv-read", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---- requests from the session ---------------------------------------

    def submit_write(self, layer: int, runs: tuple[BlockRun, ...], handle: TransferHandle,
                     ready: torch.cuda.Event | None) -> None:
        frame = self._new_request(Kind.WRITE, layer, 1, runs, handle)
        if frame is not None:
            self._jobs.put(LayerWrite(frame, ready))

    def submit_read(self, runs: tuple[BlockRun, ...], handle: TransferHandle) -> None:
        frame = self._new_request(Kind.READ, 0, self.layout.num_layers, runs, handle)
        if frame is not None:
            self._jobs.put(lambda: self.sock.sendall(encode_frame(frame)))

    def _new_request(self, kind: Kind, layer: int, layer_count: int, runs: tuple[BlockRun, ...],
                     handle: TransferHandle) -> Frame | None:
        payload = layer_count * sum(r.count for r in runs) * self.block_bytes if kind == Kind.WRITE else 0
        with self._lock:
            if self._closed:
                handle.part_done(f"connection to {self.peer.name} is closed")
                return None
            request_id = next(self._ids)
            frame = Frame(kind, self.checksum, request_id, layer, layer_count, runs, payload)
            self._pending[request_id] = (handle, frame if kind == Kind.READ else None)
        return frame

    # ---- sender thread -----------------------------------------------------

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, list):
                    self._send_writes(job)
                else:
                    job()
            except OSError as exc:  # socket.timeout included: the peer stopped reading
                self.close(f"send to {self.peer.name} failed: {exc}")
                return
            except RuntimeError as exc:  # a failed device copy must not kill the thread silently
                logger.exception("KV send to %s failed", self.peer.name)
                self.close(f"send to {self.peer.name} failed: {exc}")
                return

    def _send_writes(self, writes: list[LayerWrite]) -> None:
        """Send pushed layers as one WRITE frame, answered by one ACK (or ERROR) for all of them."""
        frame = writes[0].frame
        if len(writes) > 1:
            with self._lock:  # before the frame leaves: its answer may come at once
                self._merged[frame.request_id] = [write.frame.request_id for write in writes[1:]]
            frame = dataclasses.replace(frame, layer_count=len(writes),
                                        payload_bytes=sum(write.frame.payload_bytes for write in writes))
        for write in writes[:-1]:  # CUDA: pushes from another stream are not covered by the last event
            if write.ready is not None:
                write.ready.synchronize()
        self._send_kv(frame, writes[-1].ready)

    def _send_kv(self, frame: Frame, ready: torch.cuda.Event | None = None) -> None:
        hasher = new_hasher(frame.checksum)
        self.sock.sendall(encode_frame(frame))
        self.payload.send(self.sock, payload_segments(frame, "src"), hasher, ready)
        self.sock.sendall(TRAILER.pack(hasher.value()))
        self.bytes_sent += frame.payload_bytes

    def _send_granted(self, data: Frame) -> None:
        """Answer a READ with DATA, its grant checked as the bytes leave (not when the READ came in:
        the blocks may have been released and reused since) and its blocks in use until they left."""
        blocks = frame_blocks(data, "src")
        error = self.access.use(self.peer.name, Access.READ, blocks)
        if error is not None:
            frame, payload = control_frame(Kind.ERROR, data.request_id, error)
            self.sock.sendall(encode_frame(frame) + payload)
            return
        try:
            self._send_kv(data)
        finally:
            self.access.done_with(blocks)

    def _control(self, kind: Kind, request_id: int, reason: str = "") -> Callable[[], None]:
        frame, payload = control_frame(kind, request_id, reason)
        return lambda: self.sock.sendall(encode_frame(frame) + payload)

    def _answer(self, job: Callable[[], None]) -> None:
        """Queue an answer to a peer's frame, counted until sent (see MAX_WAITING_ANSWERS)."""
        with self._lock:
            if self._waiting_answers >= MAX_WAITING_ANSWERS:
                raise FrameError(f"{MAX_WAITING_ANSWERS} answers wait to be sent: the peer asks faster than it reads")
            self._waiting_answers += 1

        def counted() -> None:
            try:
                job()
            finally:
                with self._lock:
                    self._waiting_answers -= 1
        self._jobs.put(counted)

    # ---- reader thread -----------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while not self._closed:
                readable, _, _ = select.select([self.sock], [], [], _IDLE_POLL_S)
                if readable:
                    self._read_one()
        except FrameError as exc:
            # NOTE: after a malformed frame the byte stream cannot be resynchronised.
            reason = f"protocol error: {exc}"
            logger.warning("bad frame from %s: %s", self.peer.name, reason)
            self._jobs.put(self._control(Kind.ERROR, 0, reason))
            self._jobs.put(lambda: self._close_after_telling(reason))
        except (OSError, ConnectionError, ValueError) as exc:
            self.close(f"connection to {self.peer.name} lost: {exc}")

    def _read_one(self) -> None:
        layout = self.layout
        frame = recv_frame(self.sock, layout.num_blocks, layout.num_layers, self.block_bytes)
        if frame.kind == Kind.WRITE:
            blocks = frame_blocks(frame, "dst")
            error = self._check_incoming(frame, blocks)
            if error is None:
                try:
                    error = self._recv_kv(frame)
                finally:
                    self.access.done_with(blocks)
            else:
                self.payload.discard(self.sock, payload_segments(frame, "dst"))
                recv_exact(self.sock, TRAILER.size)
            self._answer(self._control(Kind.ERROR if error else Kind.ACK, frame.request_id, error or ""))
        elif frame.kind == Kind.READ:
            error = range_error(frame, layout.num_layers, layout.num_blocks, "src")
            if error is None:
                data = Frame(Kind.DATA, self.checksum, frame.request_id, frame.layer, frame.layer_count,
                             frame.runs, frame.layer_count * frame.num_blocks * self.block_bytes)
                self._answer(lambda: self._send_granted(data))
            else:
                self._answer(self._control(Kind.ERROR, frame.request_id, error))
        elif frame.kind == Kind.DATA:
            handle = self._expected_data(frame)
            handle.part_done(self._recv_kv(frame))
        elif frame.kind == Kind.ACK:
            self._finish(frame.request_id, None, acknowledged=True)
        else:
            reason = recv_exact(self.sock, frame.payload_bytes).decode("utf-8", errors="replace")
            if frame.request_id == 0:
                raise ConnectionError(f"peer reported: {reason}")
            self._finish(frame.request_id, f"{self.peer.name}: {reason}")

    def _check_incoming(self, frame: Frame, blocks: list[int]) -> str | None:
        """Why a WRITE into `blocks` (its destination) is refused; None: they are in use until stored."""
        if frame.checksum != self.checksum:
            return f"checksum kind {frame.checksum} differs from the negotiated {self.checksum}"
        return range_error(frame, self.layout.num_layers, self.layout.num_blocks, "dst") or self.access.use(
            self.peer.name, Access.WRITE, blocks)

    def _recv_kv(self, frame: Frame) -> str | None:
        """Receive a frame's payload into its destination blocks; the reason if it fails its checksum."""
        hasher = new_hasher(frame.checksum)
        self.payload.recv(self.sock, payload_segments(frame, "dst"), hasher)
        (sent,) = TRAILER.unpack(recv_exact(self.sock, TRAILER.size))
        self.bytes_received += frame.payload_bytes
        if sent != hasher.value():
            return (f"checksum mismatch on {frame.payload_bytes} bytes of layers {frame.layer}.."
                    f"{frame.layer + frame.layer_count - 1} (sent {sent:#x}, received {hasher.value():#x})")
        return None

    def _expected_data(self, frame: Frame) -> TransferHandle:
        with self._lock:
            handle, asked = self._pending.pop(frame.request_id, (None, None))
        if (handle is None or asked is None or (asked.runs, asked.layer, asked.layer_count) != (
                frame.runs, frame.layer, frame.layer_count) or frame.checksum != self.checksum):
            if handle is not None:
                handle.part_done(f"{self.peer.name} answered request {frame.request_id} with other blocks")
            raise FrameError(f"DATA for request {frame.request_id} that was not asked for")
        return handle

    def _finish(self, request_id: int, error: str | None, acknowledged: bool = False) -> None:
        with self._lock:
            handle, asked = self._pending.pop(request_id, (None, None))
            merged = [self._pending.pop(later, (None, None))[0] for later in self._merged.pop(request_id, ())]
        if handle is None:
            logger.warning("answer for unknown request %d from %s", request_id, self.peer.name)
            return
        if acknowledged and asked is not None:  # only DATA completes a READ: an ACK would leave the blocks unfilled
            handle.part_done(f"{self.peer.name} acknowledged READ request {request_id} without its data")
            raise FrameError(f"ACK for READ request {request_id}")
        for answered in (handle, *merged):
            if answered is not None:
                answered.part_done(error)

    # ---- shutdown ------------------------------------------------------------

    def _close_after_telling(self, reason: str) -> None:
        """Close once the ERROR frame queued before this is on its way: its FIN follows it, and what
        the peer sent meanwhile is read and dropped until it goes quiet, for at most
        _TELLING_LINGER_S. Closed with unread bytes, the socket would answer with a reset, which can
        discard the ERROR frame before the peer reads it (seen in CI)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # gone already: close() below is all that is left
        else:
            drop_until_quiet(self.sock, time.monotonic() + _TELLING_LINGER_S)
        self.close(reason)

    def close(self, reason: str) -> None:
        """Fail what is pending with `reason` and shut the socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
        for handle, _ in pending:
            handle.part_done(reason)
        self._jobs.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already disconnected
        self.sock.close()
        self._on_broken(reason)

    @property
    def is_open(self) -> bool:
        return not self._closed


class TcpSession(TransferSession):
    """A link to one peer over several connections; each transfer is split across them."""

    def __init__(self, peer: PeerInfo, conns: list[_Connection], layout: KVLayout, is_cuda: bool) -> None:
        self.peer = peer
        self.layout = layout
        self._block_bytes = layout.block_bytes  # once: a KVLayout property, needed per segment
        self._conns = conns
        self._is_cuda = is_cuda
        self._pending = PendingTransfers()
        self._rotation = itertools.count()

    def push(self, layer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> TransferHandle:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range ({self.layout.num_layers} layers)")
        parts = plan_runs(tuple(src_blocks), tuple(dst_blocks), self.layout.num_blocks,
                          self.peer.layout.num_blocks, len(self._conns))
        ready = torch.cuda.current_stream().record_event() if self._is_cuda else None
        return self._spread(parts, len(src_blocks),
                            lambda conn, part, handle: conn.submit_write(layer, part, handle, ready))

    def pull(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> TransferHandle:
        parts = plan_runs(tuple(src_blocks), tuple(dst_blocks), self.peer.layout.num_blocks,
                          self.layout.num_blocks, len(self._conns))
        return self._spread(parts, len(src_blocks) * self.layout.num_layers,
                            lambda conn, part, handle: conn.submit_read(part, handle))

    def _spread(self, parts: tuple[tuple[BlockRun, ...], ...], layer_blocks: int,
                submit: Callable[[_Connection, tuple[BlockRun, ...], TransferHandle], None]) -> TransferHandle:
        """Submit each part on its own connection; `layer_blocks`: blocks x layers the transfer moves."""
        handle = TransferHandle(len(parts), layer_blocks * self._block_bytes)
        # Rotate the first connection so that small (one-part) transfers spread too.
        start = next(self._rotation)
        for i, part in enumerate(parts):
            submit(self._conns[(start + i) % len(self._conns)], part, handle)
        self._pending.add(handle)
        return handle

    def flush(self, timeout: float) -> None:
        self._pending.wait_all(timeout, self.peer.name)

    def close(self) -> None:
        for conn in self._conns:
            conn.close("session closed")

    def _on_broken(self, reason: str) -> None:
        # One lost connection breaks the link: requests spread over all of them.
        for conn in self._conns:
            conn.close(reason)

    @property
    def is_open(self) -> bool:
        return all(conn.is_open for conn in self._conns)

    @property
    def checksum(self) -> ChecksumKind:
        """The payload checksum the handshake settled on (one for every connection)."""
        return self._conns[0].checksum

    @property
    def bytes_sent(self) -> int:
        return sum(conn.bytes_sent for conn in self._conns)

    @property
    def bytes_received(self) -> int:
        return sum(conn.bytes_received for conn in self._conns)


class TcpTransport(LinkedTransport):
    """KV blocks over TCP: any two machines; the CPU and CI path."""

    name = "tcp"

    def _payloads(self, socks: list[socket.socket], extras: dict[str, Any], initiator: bool) -> list[PayloadIO]:
        """How each connection moves KV bytes: over its own socket here; NCCL overrides this."""
        return [PoolIO(self.pool, self.layout) for _ in socks]

    def _open_session(self, peer: PeerInfo, socks: list[socket.socket], checksum: int,
                      extras: dict[str, Any], initiator: bool) -> TransferSession:
        conns: list[_Connection] = []
        session = TcpSession(peer, conns, self.layout, self.pool.device.type == "cuda")
        for sock, payload in zip(socks, self._payloads(socks, extras, initiator), strict=True):
            conns.append(_Connection(sock, payload, self.layout, peer, ChecksumKind(checksum),
                                     self.io_timeout, session._on_broken, self.access))
        return session
