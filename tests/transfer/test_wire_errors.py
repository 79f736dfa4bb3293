"""Frames on the wire: bad ones get errors and the serving peer keeps serving; pushed layers
that queue up behind a slow socket leave as one frame, answered once."""

from __future__ import annotations

import itertools
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from disagg.workers.transfer import KVLayout, KVTransport, PeerInfo
from disagg.workers.transfer.base import BlockRun, TransferError
from disagg.workers.transfer.handshake import Hello, initiate
from disagg.workers.transfer.pool_io import host_view
from disagg.workers.transfer.send_queue import MAX_FRAME_BYTES
from disagg.workers.transfer.wire import (
    HEADER,
    MAGIC,
    TRAILER,
    ChecksumKind,
    Frame,
    Kind,
    control_frame,
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
        self.name = f"raw-{uuid.uuid4().hex[:6]}"
        me = PeerInfo(self.name, "127.0.0.1:9", layout)
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


def test_layers_pushed_faster_than_sent_leave_as_merged_frames_with_one_answer_each(
    transport_factory: Callable[..., KVTransport],
) -> None:
    # 16 MiB a layer: more than the socket buffers hold, so the sender is still on the
    # first frame while the later layers queue behind it.
    big = KVLayout("test-model", "float16", num_layers=4, num_blocks=64, block_size=64, num_kv_heads=8, head_dim=128)
    pool = torch.randn(big.shape).to(big.torch_dtype)
    prefill = transport_factory("tcp", pool, big, "prefill")
    link = RawLink(prefill.start("127.0.0.1", 0), big)
    try:
        session = prefill.session(link.name, timeout=WAIT_S)
        src, dst = list(range(0, 64, 2)) + list(range(1, 64, 2)), list(range(64))
        handles = [session.push(layer, src, dst) for layer in range(big.num_layers)]
        frames = []
        while sum(frame.layer_count for frame in frames) < big.num_layers:
            frame = recv_frame(link.sock, big.num_blocks, big.num_layers, big.block_bytes)
            payload = recv_exact(link.sock, frame.payload_bytes)
            recv_exact(link.sock, TRAILER.size)
            expected = b"".join(bytes(host_view(pool[layer, block])) for layer in range(
                frame.layer, frame.layer + frame.layer_count) for block in src)
            assert frame.kind == Kind.WRITE and payload == expected, "layer-major, in push order"
            assert frame.payload_bytes <= MAX_FRAME_BYTES
            frames.append(frame)
        assert [frame.layer for frame in frames] == [0, *itertools.accumulate(f.layer_count for f in frames[:-1])]
        assert len(frames) < big.num_layers, "queued layers of the same blocks share a frame"
        for frame in frames[:-1]:
            link.sock.sendall(encode_frame(control_frame(Kind.ACK, frame.request_id)[0]))
        error, reason = control_frame(Kind.ERROR, frames[-1].request_id, "disk on fire")
        link.sock.sendall(encode_frame(error) + reason)
        last = frames[-1]
        for layer, handle in enumerate(handles):
            if layer < last.layer:
                handle.wait(WAIT_S)  # answered by the ACK of the frame that carried it
            else:
                with pytest.raises(TransferError, match="disk on fire"):
                    handle.wait(WAIT_S)
    finally:
        link.sock.close()
