"""The transfer listener's resources stay bounded against whoever reaches its port.

An in-process tcp transport on loopback; the "attacker" is raw sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from disagg.workers.transfer import KVLayout, KVTransport, PeerInfo, create_transport
from disagg.workers.security.key import ClusterKey
from disagg.workers.transfer.handshake import MAGIC, PREFIX, VERSION, Hello, initiate
from disagg.workers.transfer.wire import supported_checksums

LAYOUT = KVLayout("test-model", "float16", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
IO_TIMEOUT_S = 1.0


@contextlib.contextmanager
def listening(**options: object) -> Iterator[tuple[KVTransport, tuple[str, int]]]:
    pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
    transport = create_transport("tcp", pool, LAYOUT, "prefill-l", "127.0.0.1:1", **{"io_timeout": IO_TIMEOUT_S,
                                                                                       **options})
    try:
        host, port = transport.start("127.0.0.1", 0).rsplit(":", 1)
        yield transport, (host, int(port))
    finally:
        transport.close()


def closed_by_peer_within(sock: socket.socket, seconds: float) -> bool:
    """True when the other end closes `sock` within `seconds` (reading and dropping what it sends)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


def test_a_trickling_handshake_is_cut_at_one_deadline() -> None:
    """One byte every 0.3 s kept a per-recv timeout waiting forever; the whole handshake has one deadline."""
    with listening() as (_, address), socket.create_connection(address, timeout=5) as sock:
        started = time.monotonic()
        cut = False
        for _ in range(int(4 * IO_TIMEOUT_S / 0.3)):
            try:
                sock.sendall(b"D")
            except OSError:
                cut = True
                break
            if closed_by_peer_within(sock, 0.3):
                cut = True
                break
        assert cut, "the listener still holds a trickling connection"
        assert time.monotonic() - started < IO_TIMEOUT_S + 1.0


def test_idle_connections_filling_the_listener_cannot_keep_a_link_out() -> None:
    """A stranger holding every pending slot with connections that send nothing (reconnecting as
    each is dropped) kept every link out; a newcomer now drops the oldest unproven handshake."""
    key = ClusterKey(b"0123456789abcdef0123456789abcdef")
    with listening(key=key, max_pending=2, io_timeout=30.0) as (transport, address):
        held = [socket.create_connection(address, timeout=5) for _ in range(2)]
        pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
        decode = create_transport("tcp", pool, LAYOUT, "decode-l", "127.0.0.1:2", num_connections=1, key=key)
        try:
            time.sleep(0.2)  # let the listener take both
            assert decode.connect(f"{address[0]}:{address[1]}", timeout=5).is_open
            assert transport.session("decode-l", timeout=5).is_open
            assert closed_by_peer_within(held[0], 1.0), "the oldest idle connection was dropped"
        finally:
            decode.close()
            for sock in held:
                sock.close()


def test_connections_beyond_the_cap_of_proven_ones_are_closed_at_accept() -> None:
    """Slots held by connections that passed the handshake (parked for their session's other
    connections) are not dropped for a newcomer: the cap still bounds what the port holds."""
    with listening(max_pending=1, io_timeout=30.0) as (_, address), \
            socket.create_connection(address, timeout=5) as parked:
        me = PeerInfo("decode-l", "127.0.0.1:2", LAYOUT)
        hello = Hello(me, "tcp", uuid.uuid4().hex, 0, 2, [int(k) for k in supported_checksums()])
        reply, _ = initiate(parked, hello, None, time.monotonic() + 5)
        assert reply.ok, reply.reason
        with socket.create_connection(address, timeout=5) as second:
            assert closed_by_peer_within(second, 2 * 1.0), "a second connection got a slot"
        assert not closed_by_peer_within(parked, 0.2), "the parked one was dropped"


def test_a_parked_connection_of_an_incomplete_session_expires() -> None:
    """A valid handshake for connection 0 of 2 waits for its sibling only `io_timeout`."""
    with listening() as (transport, address), socket.create_connection(address, timeout=5) as sock:
        me = PeerInfo("decode-l", "127.0.0.1:2", LAYOUT)
        hello = Hello(me, "tcp", uuid.uuid4().hex, 0, 2, [int(k) for k in supported_checksums()])
        reply, _ = initiate(sock, hello, None, time.monotonic() + 5)
        assert reply.ok, reply.reason
        assert closed_by_peer_within(sock, IO_TIMEOUT_S + 2.0), "parked for good"
        assert transport.peers() == {}


def test_running_out_of_file_descriptors_does_not_end_the_accept_loop() -> None:
    with listening() as (transport, address):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # its fd exists before the limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers: list[int] = []
        try:
            highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
            with pytest.raises(OSError):  # take every free descriptor below the limit
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            client.connect(address)
            time.sleep(0.5)  # accept() fails with EMFILE meanwhile
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
        pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
        decode = create_transport("tcp", pool, LAYOUT, "decode-l", "127.0.0.1:2", num_connections=1)
        try:
            session = decode.connect(f"{address[0]}:{address[1]}", timeout=5)
            assert session.is_open and transport.session("decode-l", timeout=5).is_open
        finally:
            decode.close()


def _hello_body(**fields: object) -> dict[str, object]:
    body: dict[str, object] = {"nonce": "aa" * 16, "name": "x", "grpc_address": "a", "layout": LAYOUT.to_dict(),
                               "transport": "tcp", "session_id": "s", "conn_index": 0, "num_conns": 1,
                               "checksums": [1], "extras": {}}
    return body | fields


@pytest.mark.parametrize("body", [
    b"[" * 200_000,  # nested past the recursion limit
    json.dumps(_hello_body(conn_index=1e400)).encode().replace(b"Infinity", b"1e400"),  # an int() overflow
], ids=["deep", "overflow"])
def test_malformed_handshakes_give_their_slot_back(body: bytes) -> None:
    """Without the key, such a HELLO once killed its handshake thread holding a pending slot for good:
    `max_pending` of them and the port accepted no link again."""
    key = ClusterKey(b"0123456789abcdef0123456789abcdef")
    with listening(key=key, max_pending=2) as (_, address):
        for _ in range(3):
            with socket.create_connection(address, timeout=5) as sock:
                with contextlib.suppress(OSError):  # closed at accept while the last one's slot came back
                    sock.sendall(PREFIX.pack(MAGIC, VERSION, 1, 0, len(body)) + body)
                assert closed_by_peer_within(sock, IO_TIMEOUT_S + 2.0)
        time.sleep(0.2)  # the listener closes a connection just before it frees the slot
        pool = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
        decode = create_transport("tcp", pool, LAYOUT, "decode-l", "127.0.0.1:2", num_connections=1, key=key)
        try:
            assert decode.connect(f"{address[0]}:{address[1]}", timeout=5).is_open
        finally:
            decode.close()
