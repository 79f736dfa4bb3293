"""Bad frames get errors, and the serving peer keeps serving."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from disagg.workers.transfer import KVLayout, PeerInfo
from disagg.workers.transfer.base import BlockRun
from disagg.workers.transfer.handshake import Hello, initiate
from disagg.workers.transfer.pool_io import host_view
from disagg.workers.transfer.wire import (
    HEADER,
    MAGIC,
    TRAILER,
    ChecksumKind,
    Frame,
    Kind,
    encode_frame,
    new_hasher,
    recv_exact,
    recv_frame,
    supported_checksums,
)

WAIT_S = 30.0
Peer = Any  # conftest.Peer


class RawLink:
    """A hand-driven decode: one handshaken socket speaking raw frames."""

    def __init__(self, address: str, layout: KVLayout) -> None:
        host, port = address.rsplit(":", 1)
        self.layout = layout
        self.sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        me = PeerInfo(f"raw-{uuid.uuid4().hex[:6]}", "127.0.0.1:9", layout)
        checksums = [int(k) for k in supported_checksums()]
        reply, _ = initiate(self.sock, Hello(me, "tcp", uuid.uuid4().hex, 0, 1, checksums), None,
                            time.monotonic() + WAIT_S)
        assert reply.ok, reply.reason
        self.checksum = ChecksumKind(reply.checksum)
        self.sock.settimeout(WAIT_S)

    def write(self, layer: int, runs: list[BlockRun], corrupt: bool = False, request_id: int = 1) -> None:
        blocks = sum(r.count for r in runs)
        payload = torch.randn(blocks * self.layout.block_bytes // 2).half()
        hasher = new_hasher(self.checksum)
        hasher.update(host_view(payload))
        frame = Frame(Kind.WRITE, self.checksum, request_id, layer, 1, tuple(runs), blocks * self.layout.block_bytes)
        self.sock.sendall(encode_frame(frame) + bytes(host_view(payload)))
        self.sock.sendall(TRAILER.pack(hasher.value() ^ (1 if corrupt else 0)))

    def answer(self) -> tuple[Kind, int, str]:
        frame = recv_frame(self.sock, 1 << 20, 1 << 10, self.layout.block_bytes)
        reason = recv_exact(self.sock, frame.payload_bytes).decode() if frame.kind == Kind.ERROR else ""
        return frame.kind, frame.request_id, reason

    def is_closed_by_peer(self) -> bool:
        return closed_by_peer(self.sock)


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closed the socket (EOF, or a reset because our bytes went unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def link(listening_peer: tuple[Peer, str], layout: KVLayout) -> Iterator[RawLink]:
    raw = RawLink(listening_peer[1], layout)
    yield raw
    raw.sock.close()


def test_a_good_write_is_acknowledged(link: RawLink) -> None:
    link.write(0, [BlockRun(0, 2, 3)], request_id=41)
    assert link.answer() == (Kind.ACK, 41, "")


def test_a_corrupted_payload_fails_its_checksum_and_the_link_survives(link: RawLink) -> None:
    link.write(1, [BlockRun(0, 0, 2)], corrupt=True, request_id=5)
    kind, request_id, reason = link.answer()
    assert (kind, request_id) == (Kind.ERROR, 5) and "checksum mismatch" in reason
    link.write(1, [BlockRun(0, 0, 2)], request_id=6)
    assert link.answer() == (Kind.ACK, 6, "")


@pytest.mark.parametrize(
    ("layer", "run", "expected"),
    [(3, BlockRun(0, 0, 1), "layers 3..3 out of range"), (0, BlockRun(0, 47, 2), "dst blocks 47..48 out of range")],
)
def test_unknown_layers_and_blocks_are_refused_and_the_link_survives(
    link: RawLink, layer: int, run: BlockRun, expected: str
) -> None:
    link.write(layer, [run], request_id=7)
    kind, request_id, reason = link.answer()
    assert (kind, request_id) == (Kind.ERROR, 7) and expected in reason
    link.write(0, [BlockRun(0, 0, 1)], request_id=8)
    assert link.answer() == (Kind.ACK, 8, "")


def test_a_read_of_missing_blocks_is_refused(link: RawLink) -> None:
    frame = Frame(Kind.READ, link.checksum, 9, 0, 3, (BlockRun(46, 0, 5),), 0)
    link.sock.sendall(encode_frame(frame))
    kind, request_id, reason = link.answer()
    assert (kind, request_id) == (Kind.ERROR, 9) and "src blocks 46..50 out of range" in reason


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # claims far more payload than its runs need
        (HEADER.pack(MAGIC, Kind.WRITE, 1, 0, 3, 0, 1, 1, 1 << 40) + bytes(12), "payload bytes"),
        # a run table larger than the whole pool
        (HEADER.pack(MAGIC, Kind.WRITE, 1, 0, 3, 0, 1, 10_000, 0), "runs"),
        (HEADER.pack(b"JUNK", Kind.WRITE, 1, 0, 3, 0, 1, 0, 0), "magic"),
        (HEADER.pack(MAGIC, 99, 1, 0, 3, 0, 1, 0, 0), "unknown frame kind"),
    ],
)
def test_malformed_frames_close_that_link_only(
    link: RawLink, listening_peer: tuple[Peer, str], layout: KVLayout, raw: bytes, expected: str
) -> None:
    link.sock.sendall(raw)
    kind, request_id, reason = link.answer()
    assert (kind, request_id) == (Kind.ERROR, 0) and "protocol error" in reason and expected in reason
    assert link.is_closed_by_peer()
    fresh = RawLink(listening_peer[1], layout)  # the peer keeps serving
    try:
        fresh.write(0, [BlockRun(0, 0, 1)], request_id=3)
        assert fresh.answer() == (Kind.ACK, 3, "")
    finally:
        fresh.sock.close()


def test_a_stranger_that_is_not_a_handshake_is_dropped(listening_peer: tuple[Peer, str]) -> None:
    host, port = listening_peer[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        assert closed_by_peer(sock)
