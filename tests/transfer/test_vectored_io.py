"""Scatter-gather socket I/O of the tcp transport: batching, partial delivery, stalls, partial frames."""

from __future__ import annotations

import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from disagg.workers.transfer import KVLayout, KVTransport, PeerInfo, create_transport, pool_io, wire
from disagg.workers.transfer.base import BlockRun
from disagg.workers.transfer.handshake import Hello, initiate
from disagg.workers.transfer.pool_io import PoolIO, batches
from disagg.workers.transfer.tcp import tune_socket
from disagg.workers.transfer.wire import (
    ChecksumKind,
    Frame,
    Kind,
    encode_frame,
    recv_frame,
    recv_into_views,
    send_views,
    supported_checksums,
)

WAIT_S = 30.0
Pair = tuple[KVTransport, KVTransport, torch.Tensor, torch.Tensor]  # prefill, decode, their pools
# 8 KiB blocks, so that a frame of a few dozen blocks spans several batches once they are shrunk.
BIG = KVLayout("vectored", "float16", num_layers=2, num_blocks=40, block_size=8, num_kv_heads=2, head_dim=128)


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2], timeout=WAIT_S)
        accepted, _ = server.accept()
    yield client, accepted
    client.close()
    accepted.close()


def test_batches_cut_straddling_spans_and_keep_order() -> None:
    spans = [(0, 5), (100, 12), (200, 1)]
    got = list(batches(spans, 7))
    assert got == [[(0, 5), (100, 2)], [(102, 7)], [(109, 3), (200, 1)]]
    assert all(sum(size for _, size in batch) <= 7 for batch in got)


def test_spans_merge_neighbours_in_memory() -> None:
    io = PoolIO(torch.zeros(BIG.shape, dtype=BIG.torch_dtype), BIG)
    # blocks 3..4 then 5 of layer 0 touch; block 0 of layer 1 does not follow block 5 of layer 0
    assert io.spans([(0, 3, 2), (0, 5, 1), (1, 0, 1)]) == [
        (3 * BIG.block_bytes, 3 * BIG.block_bytes),
        (BIG.layer_bytes, BIG.block_bytes),
    ]


def test_views_arrive_whole_across_more_buffers_than_one_call_takes(
    tcp_pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "MAX_IOV", 3)
    client, server = tcp_pair
    tune_socket(server, WAIT_S)
    rng = random.Random(1)
    chunks = [rng.randbytes(rng.randint(1, 5000)) for _ in range(40)]
    sizes = [len(c) for c in chunks]
    received = [memoryview(bytearray(n)) for n in sizes]

    def trickle() -> None:
        # Many small sends with pauses: the receiver sees partial fills at arbitrary offsets.
        data = b"".join(chunks)
        for start in range(0, len(data), 7000):
            client.sendall(data[start : start + 7000])
            time.sleep(0.002)

    sender = threading.Thread(target=trickle)
    sender.start()
    recv_into_views(server, received)
    sender.join(WAIT_S)
    assert [bytes(view) for view in received] == chunks


def test_send_views_gathers_everything_in_order(tcp_pair: tuple[socket.socket, socket.socket],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_IOV", 4)
    client, server = tcp_pair
    tune_socket(client, WAIT_S)
    parts = [bytes([i]) * (i * 997 + 1) for i in range(30)]
    total = sum(len(p) for p in parts)
    sender = threading.Thread(target=send_views, args=(client, [memoryview(p) for p in parts]))
    sender.start()
    got = memoryview(bytearray(total))
    recv_into_views(server, [got])
    sender.join(WAIT_S)
    assert bytes(got) == b"".join(parts)


def test_a_stalled_sender_times_out_and_an_early_close_is_a_lost_connection(
    tcp_pair: tuple[socket.socket, socket.socket]
) -> None:
    client, server = tcp_pair
    tune_socket(server, 0.3)
    client.sendall(b"x" * 10)
    with pytest.raises(TimeoutError, match="no progress"):
        recv_into_views(server, [memoryview(bytearray(100))])
    client.sendall(b"y" * 10)
    client.close()
    with pytest.raises(ConnectionError, match="closed"):
        recv_into_views(server, [memoryview(bytearray(100))])


@pytest.fixture
def big_pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    """A prefill and a decode transport in this process, with batches and IOV limits shrunk.

    A batch of 3000 bytes cuts every 8 KiB block at uneven offsets; 5 buffers
    per call force several calls per batch.
    """
    monkeypatch.setattr(pool_io, "BATCH_BYTES", 3000)
    monkeypatch.setattr(wire, "MAX_IOV", 5)
    generator = torch.Generator().manual_seed(3)
    source = torch.randn(BIG.shape, generator=generator).to(BIG.torch_dtype)
    target = torch.zeros(BIG.shape, dtype=BIG.torch_dtype)
    prefill = create_transport("tcp", source, BIG, "prefill-v", "127.0.0.1:1", io_timeout=WAIT_S)
    decode = create_transport("tcp", target, BIG, "decode-v", "127.0.0.1:2", num_connections=2, io_timeout=WAIT_S)
    try:
        address = prefill.start("127.0.0.1", 0)
        decode.connect(address, timeout=WAIT_S)
        yield prefill, decode, source, target
    finally:
        decode.close()
        prefill.close()


def test_push_of_frames_larger_than_a_batch_lands_intact(
    big_pair: Pair
) -> None:
    prefill, _, source, target = big_pair
    session = prefill.session("decode-v", timeout=WAIT_S)
    rng = random.Random(4)
    src = list(range(0, 12)) + rng.sample(range(12, BIG.num_blocks), 20)
    dst = rng.sample(range(BIG.num_blocks), 32)
    for layer in range(BIG.num_layers):
        session.push(layer, src, dst)
    session.flush(WAIT_S)
    assert torch.equal(target[:, dst], source[:, src])
    assert not target[:, sorted(set(range(BIG.num_blocks)) - set(dst))].any()


def test_pull_of_frames_larger_than_a_batch_lands_intact(
    big_pair: Pair
) -> None:
    _, decode, source, target = big_pair
    session = decode.session("prefill-v", timeout=WAIT_S)
    src, dst = list(range(5, 35)), list(range(39, 9, -1))
    session.pull(src, dst).wait(WAIT_S)
    assert torch.equal(target[:, dst], source[:, src])


class _RawDecode:
    """A hand-driven decode on one handshaken socket."""

    def __init__(self, address: str, layout: KVLayout) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        me = PeerInfo(f"raw-{uuid.uuid4().hex[:6]}", "127.0.0.1:9", layout)
        hello = Hello(me, "tcp", uuid.uuid4().hex, 0, 1, [int(k) for k in supported_checksums()])
        reply, _ = initiate(self.sock, hello, None, time.monotonic() + WAIT_S)
        assert reply.ok, reply.reason
        self.checksum = ChecksumKind(reply.checksum)

    def write_header(self, runs: tuple[BlockRun, ...], block_bytes: int) -> int:
        """Send a WRITE header for layer 0; returns its payload size."""
        payload = sum(r.count for r in runs) * block_bytes
        self.sock.sendall(encode_frame(Frame(Kind.WRITE, self.checksum, 1, 0, 1, runs, payload)))
        return payload

    def closed_by_peer(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(4096):  # an ERROR frame may come first
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


@pytest.fixture
def impatient_prefill() -> Iterator[tuple[KVTransport, str]]:
    """A listening transport whose socket waits give up after 0.5 s."""
    pool = torch.zeros(BIG.shape, dtype=BIG.torch_dtype)
    transport = create_transport("tcp", pool, BIG, "prefill-i", "127.0.0.1:3", io_timeout=0.5)
    try:
        yield transport, transport.start("127.0.0.1", 0)
    finally:
        transport.close()


def _acknowledged_write(address: str) -> Kind:
    fresh = _RawDecode(address, BIG)
    try:
        run = (BlockRun(0, 1, 1),)
        fresh.write_header(run, BIG.block_bytes)
        fresh.sock.sendall(bytes(BIG.block_bytes))
        hasher = wire.new_hasher(fresh.checksum)
        hasher.update(memoryview(bytes(BIG.block_bytes)))
        fresh.sock.sendall(wire.TRAILER.pack(hasher.value()))
        return recv_frame(fresh.sock, BIG.num_blocks, BIG.num_layers, BIG.block_bytes).kind
    finally:
        fresh.sock.close()


@pytest.mark.parametrize("then_close", [False, True])
def test_a_partial_frame_drops_that_link_only(impatient_prefill: tuple[KVTransport, str], then_close: bool) -> None:
    transport, address = impatient_prefill
    raw = _RawDecode(address, BIG)
    deadline = time.monotonic() + WAIT_S
    while not transport.peers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert transport.peers()
    payload = raw.write_header((BlockRun(0, 0, 4),), BIG.block_bytes)
    raw.sock.sendall(bytes(payload // 2))  # half the payload, then a stall or a close
    if then_close:
        raw.sock.shutdown(socket.SHUT_WR)
    assert raw.closed_by_peer(WAIT_S)  # within io_timeout (0.5 s) for a stall, at once for a close
    raw.sock.close()
    deadline = time.monotonic() + WAIT_S
    while transport.peers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert transport.peers() == {}
    assert _acknowledged_write(address) == Kind.ACK  # the transport keeps serving
