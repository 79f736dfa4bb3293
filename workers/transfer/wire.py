"""Frames of the transfer connection after the handshake, and the payload checksums.

Every frame is a fixed header, then a run table, then the payload, then a
checksum trailer (only for frames that carry KV bytes):

    header  <4s B B H Q I I I Q>  magic "DKVF", kind, checksum kind, reserved,
                                  request id, first layer, layer count,
                                  run count, payload bytes
    runs    run count x <I I I>   (src block, dst block, count)
    payload layer-major: for each layer, for each run, the run's bytes
    trailer <Q>                   checksum of the payload (frames with KV bytes)

| kind  | sender      | receiver does                                      | payload          |
|-------|-------------|----------------------------------------------------|------------------|
| WRITE | data owner  | stores the runs at `dst`, answers ACK or ERROR     | KV bytes         |
| READ  | data wanter | answers DATA with its blocks at `src`, or ERROR    | none             |
| DATA  | data owner  | stores the runs at `dst` (answer to a READ)        | KV bytes         |
| ACK   | receiver    | completes the request                              | none             |
| ERROR | either      | fails the request                                  | utf-8 reason     |

Payloads move with scatter-gather calls (`send_views`, `recv_into_views`):
one `sendmsg` / `recvmsg_into` per batch of block runs, straight from and into
the pools' memory.

The checksum is there to catch bytes damaged on the way, not an attacker:
xxh3-64 when both sides have `xxhash` (about twice as fast as zlib's crc32
here), else crc32. By default (`checksum_preference`) a link skips it where it
buys nothing and costs a quarter of the throughput (a link within one host,
a TLS link).
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import socket
import ssl
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Protocol

from disagg.workers.transfer.base import BlockRun

# Optional speed-up (PyPI `xxhash`); crc32 is always there.
xxhash: ModuleType | None = importlib.import_module("xxhash") if importlib.util.find_spec("xxhash") else None

MAGIC = b"DKVF"
HEADER = struct.Struct("<4sBBHQIIIQ")
RUN = struct.Struct("<III")
TRAILER = struct.Struct("<Q")
MAX_REASON_BYTES = 4096
# Buffers per sendmsg / recvmsg_into call: well under Linux's UIO_MAXIOV (1024).
MAX_IOV = 512


class Kind(IntEnum):
    WRITE = 1
    READ = 2
    DATA = 3
    ACK = 4
    ERROR = 5


class ChecksumKind(IntEnum):
    NONE = 0  # for transports whose bytes do not cross a socket (nccl)
    CRC32 = 1
    XXH3 = 2


class FrameError(ValueError):
    """A frame that breaks the protocol; the connection cannot be trusted afterwards."""


class Hasher(Protocol):
    def update(self, data: memoryview) -> None: ...

    def value(self) -> int: ...


class _Crc32:
    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: memoryview) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        return self._crc


class _Xxh3:
    def __init__(self) -> None:
        assert xxhash is not None, "XXH3 is only negotiated when xxhash imports"
        self._state = xxhash.xxh3_64()

    def update(self, data: memoryview) -> None:
        self._state.update(data)

    def value(self) -> int:
        return int(self._state.intdigest())


class _NoChecksum:
    def update(self, data: memoryview) -> None:
        pass

    def value(self) -> int:
        return 0


def supported_checksums() -> list[ChecksumKind]:
    """Checksum kinds this process can compute, best first."""
    return ([ChecksumKind.XXH3] if xxhash is not None else []) + [ChecksumKind.CRC32]


def checksum_preference(peer_host: str, tls: bool) -> list[ChecksumKind]:
    """The kinds an accepting side takes by default on a connection, best first.

    No checksum first where it buys nothing: a peer on a loopback address (its
    bytes never cross a wire; the kernel copies memory to memory, as `cuda_ipc`
    does with no checksum) or a TLS connection (every record is already
    authenticated). There hashing both ends would only cost (about a quarter
    of loopback throughput). Elsewhere a checksum first: it backs up TCP's
    16-bit checksum, which lets rare corrupted segments through.

    Args:
        peer_host: the peer's IP address as the socket reports it.
    """
    host = ipaddress.ip_address(peer_host)
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
        host = host.ipv4_mapped
    checked = supported_checksums()
    return [ChecksumKind.NONE, *checked] if tls or host.is_loopback else [*checked, ChecksumKind.NONE]


def new_hasher(kind: ChecksumKind) -> Hasher:
    if kind == ChecksumKind.XXH3:
        return _Xxh3()
    if kind == ChecksumKind.CRC32:
        return _Crc32()
    return _NoChecksum()


@dataclass(frozen=True)
class Frame:
    """A decoded header and run table (the payload is streamed separately)."""

    kind: Kind
    checksum: ChecksumKind
    request_id: int
    layer: int
    layer_count: int
    runs: tuple[BlockRun, ...]
    payload_bytes: int

    @property
    def num_blocks(self) -> int:
        return sum(run.count for run in self.runs)

    @property
    def carries_kv(self) -> bool:
        return self.kind in (Kind.WRITE, Kind.DATA)


def encode_frame(frame: Frame) -> bytes:
    """Header and run table of `frame`."""
    header = HEADER.pack(
        MAGIC,
        frame.kind,
        frame.checksum,
        0,
        frame.request_id,
        frame.layer,
        frame.layer_count,
        len(frame.runs),
        frame.payload_bytes,
    )
    return header + b"".join(RUN.pack(run.src, run.dst, run.count) for run in frame.runs)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Read exactly `size` bytes. Raises ConnectionError on EOF (socket timeouts propagate)."""
    buffer = bytearray(size)
    recv_into_views(sock, [memoryview(buffer)])
    return bytes(buffer)


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """What is left of `views` once their first `done` bytes have moved."""
    index = 0
    while index < len(views) and done >= len(views[index]):
        done -= len(views[index])
        index += 1
    left = views[index:]
    if done:
        left[0] = left[0][done:]
    return left


def _timed_out(exc: OSError, what: str) -> TimeoutError:
    # A blocking socket whose SO_RCVTIMEO / SO_SNDTIMEO ran out reports EAGAIN.
    return TimeoutError(f"{what} made no progress within the socket timeout ({exc})")


def recv_into_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, in order, with as few system calls as the kernel allows.

    One `recvmsg_into` scatters into many views; MSG_WAITALL makes a blocking
    socket return only when they are full (or on timeout, signal or EOF, which
    the loop handles). Raises ConnectionError on EOF, TimeoutError on a stall.
    """
    left = [view for view in views if len(view)]
    tls = isinstance(sock, ssl.SSLSocket)  # TLS has no scatter-gather calls: one view at a time
    while left:
        try:
            n = sock.recv_into(left[0]) if tls else sock.recvmsg_into(left[:MAX_IOV], 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, ssl.SSLWantReadError) as exc:
            raise _timed_out(exc, "receive") from exc
        if n == 0:
            raise ConnectionError("peer closed the transfer connection")
        left = _advance(left, n)


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes], flags: int = 0) -> None:
    """Send every buffer, in order, gathered into as few `sendmsg` calls as the kernel allows."""
    left = [memoryview(view) for view in views if len(view)]
    tls = isinstance(sock, ssl.SSLSocket)
    while left:
        try:
            n = sock.send(left[0]) if tls else sock.sendmsg(left[:MAX_IOV], (), flags)
        except (BlockingIOError, ssl.SSLWantWriteError) as exc:
            raise _timed_out(exc, "send") from exc
        left = _advance(left, n)


def recv_frame(sock: socket.socket, max_blocks: int, max_layers: int, block_bytes: int) -> Frame:
    """Read and check one header and run table.

    Raises FrameError when the frame cannot be trusted (bad magic, unknown
    kind, oversized, or sizes that disagree): the caller must drop the
    connection. Range checks against the pool come later, per kind, because a
    well-formed frame with a bad block id only fails that one request.
    """
    magic, kind, checksum, _, request_id, layer, layer_count, num_runs, payload = HEADER.unpack(
        recv_exact(sock, HEADER.size)
    )
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r}")
    if kind not in Kind.__members__.values():
        raise FrameError(f"unknown frame kind {kind}")
    if checksum not in ChecksumKind.__members__.values():
        raise FrameError(f"unknown checksum kind {checksum}")
    if num_runs > max_blocks:
        raise FrameError(f"frame has {num_runs} runs, more than the {max_blocks} blocks of the pool")
    runs = tuple(BlockRun(*entry) for entry in RUN.iter_unpack(recv_exact(sock, num_runs * RUN.size)))
    frame = Frame(Kind(kind), ChecksumKind(checksum), request_id, layer, layer_count, runs, payload)
    if frame.carries_kv or frame.kind == Kind.READ:
        if layer_count == 0 or layer_count > max_layers or frame.num_blocks > max_blocks:
            raise FrameError(
                f"oversized frame: {layer_count} layers x {frame.num_blocks} blocks "
                f"(pool has {max_layers} layers x {max_blocks} blocks)"
            )
        expected = layer_count * frame.num_blocks * block_bytes if frame.carries_kv else 0
        if payload != expected:
            raise FrameError(f"frame says {payload} payload bytes, its runs need {expected}")
    elif frame.kind == Kind.ERROR and payload > MAX_REASON_BYTES:
        raise FrameError(f"error reason of {payload} bytes is over {MAX_REASON_BYTES}")
    elif frame.kind == Kind.ACK and payload != 0:
        raise FrameError("ACK frames carry no payload")
    return frame


def frame_blocks(frame: Frame, side: str) -> list[int]:
    """The local blocks a frame's runs name on `side` ("dst" or "src", as in `range_error`)."""
    return [(run.dst if side == "dst" else run.src) + i for run in frame.runs for i in range(run.count)]


def range_error(frame: Frame, num_layers: int, num_blocks: int, side: str) -> str | None:
    """Why the runs of a well-formed frame do not fit the local pool, or None.

    Args:
        side: "dst" for frames whose bytes land here, "src" for READs served from here.
    """
    if frame.layer + frame.layer_count > num_layers:
        return f"layers {frame.layer}..{frame.layer + frame.layer_count - 1} out of range ({num_layers} layers)"
    for run in frame.runs:
        start = run.dst if side == "dst" else run.src
        if run.count == 0 or start + run.count > num_blocks:
            return f"{side} blocks {start}..{start + run.count - 1} out of range ({num_blocks} blocks)"
    return None


def control_frame(kind: Kind, request_id: int, reason: str = "") -> tuple[Frame, bytes]:
    """An ACK or ERROR frame and its payload (the utf-8 reason, cut to fit)."""
    payload = reason.encode("utf-8", errors="replace")[:MAX_REASON_BYTES]
    return Frame(kind, ChecksumKind.NONE, request_id, 0, 0, (), len(payload)), payload


def payload_segments(frame: Frame, side: str) -> Sequence[tuple[int, int, int]]:
    """(layer, first block, count) of each payload segment, in wire order."""
    return [
        (layer, run.dst if side == "dst" else run.src, run.count)
        for layer in range(frame.layer, frame.layer + frame.layer_count)
        for run in frame.runs
    ]
