"""A linked peer that answers wrongly, or whose frames outlive their grants: our side fails the
transfer instead of taking it, and never frees blocks a frame still moves.

Our tcp transport against a hand-driven acceptor on loopback (raw frames), and two real transports.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from disagg.workers.transfer import (
    Access,
    BlockAccess,
    KVLayout,
    PeerInfo,
    TransferError,
    create_transport,
    tcp,
)
from disagg.workers.transfer.base import BlockRun
from disagg.workers.transfer.handshake import (
    Challenge,
    Hello,
    Reply,
    initiate,
    recv_hello,
    recv_proof,
    send_challenge,
    send_reply,
)
from disagg.workers.transfer.wire import (
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

LAYOUT = KVLayout("test-model", "float16", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
WAIT_S = 10.0


@contextlib.contextmanager
def rogue_acceptor() -> Iterator[tuple[str, list[socket.socket]]]:
    """A listener that completes the handshake by hand (no key) and hands over the socket."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        sock, _ = server.accept()
        deadline = time.monotonic() + WAIT_S
        hello = recv_hello(sock, deadline)
        send_challenge(sock, Challenge(uuid.uuid4().hex, "rogue"))
        recv_proof(sock, deadline)
        send_reply(sock, Reply(True, "", PeerInfo("rogue", "127.0.0.1:9", LAYOUT), hello.checksums[0]))
        accepted.append(sock)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        server.close()
        for sock in accepted:
            sock.close()


def _pull_answered_by(answer: str) -> str:
    pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
    decode = create_transport("tcp", pool, LAYOUT, "decode-r", "127.0.0.1:2", num_connections=1)
    try:
        with rogue_acceptor() as (address, accepted):
            session = decode.connect(address, timeout=WAIT_S)
            handle = session.pull([0, 1], [2, 3])
            sock = accepted[0]
            read = recv_frame(sock, LAYOUT.num_blocks, LAYOUT.num_layers, LAYOUT.block_bytes)
            assert read.kind == Kind.READ
            if answer == "ack":
                frame, payload = control_frame(Kind.ACK, read.request_id)
                sock.sendall(encode_frame(frame) + payload)
            else:  # DATA of the right size, for the wrong layer
                kind = ChecksumKind(read.checksum)
                payload = bytes(read.layer_count * read.num_blocks * LAYOUT.block_bytes)
                hasher = new_hasher(kind)
                hasher.update(memoryview(payload))
                other = Frame(Kind.DATA, kind, read.request_id, read.layer + 1, read.layer_count, read.runs,
                              len(payload))
                sock.sendall(encode_frame(other) + payload + TRAILER.pack(hasher.value()))
            with pytest.raises(TransferError) as err:
                handle.wait(WAIT_S)
            return str(err.value)
    finally:
        decode.close()


def test_an_ack_does_not_complete_a_pull() -> None:
    """Only DATA fills the pulled blocks: an ACK would leave a decode generating from whatever they held."""
    assert "without its data" in _pull_answered_by("ack")


def test_data_for_another_layer_fails_the_pull() -> None:
    assert "other blocks" in _pull_answered_by("data-for-another-layer")


def test_a_frame_in_flight_keeps_its_blocks_in_use_past_the_revoke() -> None:
    """A WRITE whose payload is still arriving when its grant is revoked: whoever frees the blocks
    waits until the frame has stored them (else they would land in another request's blocks)."""
    pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
    decode = create_transport("tcp", pool, LAYOUT, "decode-r", "127.0.0.1:2", io_timeout=WAIT_S,
                              access=BlockAccess())
    host, port = decode.start("127.0.0.1", 0).rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
            me = PeerInfo("prefill-r", "127.0.0.1:9", LAYOUT)
            reply, _ = initiate(sock, Hello(me, "tcp", uuid.uuid4().hex, 0, 1, [int(k) for k in supported_checksums()]),
                                None, time.monotonic() + WAIT_S)
            assert reply.ok, reply.reason
            decode.access.allow("prefill-r", "req", [2, 3], Access.WRITE)
            kind = ChecksumKind(reply.checksum)
            payload = bytes(2 * LAYOUT.block_bytes)
            hasher = new_hasher(kind)
            hasher.update(memoryview(payload))
            frame = Frame(Kind.WRITE, kind, 77, 0, 1, (BlockRun(0, 2, 2),), len(payload))
            sock.sendall(encode_frame(frame) + payload[: len(payload) // 2])  # the rest held back
            deadline = time.monotonic() + WAIT_S
            while not decode.access.in_use([2, 3]):
                assert time.monotonic() < deadline, "the decode never started storing the frame"
                time.sleep(0.01)
            assert decode.access.revoke("req") == (2, 3)
            assert not decode.access.wait_unused([2, 3], 0.2), "the half-stored frame still moves blocks 2 and 3"
            sock.sendall(payload[len(payload) // 2:] + TRAILER.pack(hasher.value()))
            assert decode.access.wait_unused([2, 3], WAIT_S)
            answer = recv_frame(sock, LAYOUT.num_blocks, LAYOUT.num_layers, LAYOUT.block_bytes)
            assert answer.kind == Kind.ACK  # granted when it began
            assert decode.access.refusal("prefill-r", Access.WRITE, [2]) is not None  # not for later frames
    finally:
        decode.close()


def _linked_by_hand(address: str, name: str, layout: KVLayout) -> tuple[socket.socket, ChecksumKind]:
    """A raw socket handshaken with the transport listening at `address` as the peer `name` (no key)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    me = PeerInfo(name, "127.0.0.1:9", layout)
    reply, _ = initiate(sock, Hello(me, "tcp", uuid.uuid4().hex, 0, 1, [int(k) for k in supported_checksums()]),
                        None, time.monotonic() + WAIT_S)
    assert reply.ok, reply.reason
    return sock, ChecksumKind(reply.checksum)


def test_a_peer_that_asks_without_reading_is_cut_off() -> None:
    """READs sent far faster than their DATA is read: the answers waiting to be sent stay bounded,
    and the peer is told why and cut off, instead of the queue growing with every READ."""
    layout = KVLayout("test-model", "float32", num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2,
                      head_dim=32)
    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    prefill = create_transport("tcp", pool, layout, "prefill-r", "127.0.0.1:2", io_timeout=WAIT_S,
                               access=BlockAccess())
    try:
        sock, kind = _linked_by_hand(prefill.start("127.0.0.1", 0), "decode-r", layout)
        with sock:
            prefill.access.allow("decode-r", "req", range(layout.num_blocks), Access.READ)
            asked = tcp.MAX_WAITING_ANSWERS + 1000
            runs = (BlockRun(0, 0, layout.num_blocks),)
            sock.sendall(b"".join(encode_frame(Frame(Kind.READ, kind, request_id, 0, layout.num_layers, runs, 0))
                                  for request_id in range(1, asked + 1)))
            answered = 0
            while True:
                frame = recv_frame(sock, layout.num_blocks, layout.num_layers, layout.block_bytes)
                if frame.kind != Kind.DATA:
                    break
                answered += 1
                recv_exact(sock, frame.payload_bytes + TRAILER.size)
            reason = recv_exact(sock, frame.payload_bytes).decode()
            assert (frame.kind, frame.request_id) == (Kind.ERROR, 0), frame
            assert "asks faster than it reads" in reason
            assert answered < asked
            assert sock.recv(1) == b"", "the connection stays open"
    finally:
        prefill.close()


def test_closed_sessions_leave_the_table_as_others_link() -> None:
    """Peers that come and go under new names (pods replaced) do not pile up in the session table."""
    pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
    prefill = create_transport("tcp", pool, LAYOUT, "prefill-r", "127.0.0.1:2", io_timeout=WAIT_S)
    try:
        address = prefill.start("127.0.0.1", 0)
        first, _ = _linked_by_hand(address, "decode-old", LAYOUT)
        deadline = time.monotonic() + WAIT_S
        while "decode-old" not in prefill.peers():
            assert time.monotonic() < deadline, "the first peer never linked"
            time.sleep(0.01)
        first.close()
        while "decode-old" in prefill.peers():
            assert time.monotonic() < deadline, "the first peer's close was never noticed"
            time.sleep(0.01)
        second, _ = _linked_by_hand(address, "decode-new", LAYOUT)
        with second:
            while "decode-new" not in prefill.peers():
                assert time.monotonic() < deadline, "the second peer never linked"
                time.sleep(0.01)
            assert set(prefill._sessions) == {"decode-new"}  # the table itself, not the open view of it
    finally:
        prefill.close()
