"""The tcp transport between real processes on 127.0.0.1."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.workers.transfer import KVLayout, LinkRefusedError, TransferError, TransferTimeout, create_transport
from disagg.workers.transfer.link import LinkedTransport
from disagg.workers.transfer.tcp import drop_until_quiet

WAIT_S = 30.0
Peer = Any  # conftest.Peer: a peer process (conftest is not importable under importlib mode)
SeededPool = Callable[[KVLayout, int], torch.Tensor]


def _decode(layout: KVLayout, connections: int = 2) -> tuple[LinkedTransport, torch.Tensor]:
    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    transport = create_transport("tcp", pool, layout, "decode-0", "127.0.0.1:1", num_connections=connections)
    assert isinstance(transport, LinkedTransport)
    return transport, pool


def test_handshake_links_and_names_the_peer(layout: KVLayout, listening_peer: tuple[Peer, str]) -> None:
    _, address = listening_peer
    transport, _ = _decode(layout)
    try:
        session = transport.connect(address, timeout=WAIT_S)
        assert session.is_open and session.peer.name == "prefill-0" and session.peer.layout == layout
        assert set(transport.peers()) == {"prefill-0"}
    finally:
        transport.close()
    assert not session.is_open


def test_a_link_refused_for_the_name_leaves_the_live_session_with_that_peer(
    layout: KVLayout, listening_peer: tuple[Peer, str], seeded_pool: SeededPool
) -> None:
    """A LinkInstance naming another instance at a linked prefill's transfer address: refused
    before its proof, so the prefill does not replace (and close) its session with this decode."""
    _, address = listening_peer
    source = seeded_pool(layout, 7)
    transport, pool = _decode(layout)
    try:
        live = transport.connect(address, timeout=WAIT_S)
        with pytest.raises(LinkRefusedError, match="not the 'prefill-9' the link names"):
            transport.connect(address, timeout=WAIT_S, expect_name="prefill-9")
        time.sleep(0.5)  # what a replaced session's close would take to reach this side
        assert live.is_open and transport.peers()["prefill-0"] is live.peer
        live.pull([3], [5]).wait(WAIT_S)
        assert torch.equal(pool[:, [5]], source[:, [3]])
    finally:
        transport.close()


@pytest.mark.parametrize(("field", "value"), [("block_size", 8), ("model", "another-model"), ("dtype", "float32")])
def test_layout_mismatch_is_refused_with_a_reason(
    layout: KVLayout, listening_peer: tuple[Peer, str], field: str, value: object
) -> None:
    _, address = listening_peer
    transport, _ = _decode(replace(layout, **{field: value}))
    try:
        with pytest.raises(LinkRefusedError, match=f"{field}: ours"):
            transport.connect(address, timeout=WAIT_S)
        assert transport.peers() == {}
    finally:
        transport.close()
    good, _ = _decode(layout)  # the refusing side keeps serving
    try:
        assert good.connect(address, timeout=WAIT_S).is_open
    finally:
        good.close()


@pytest.mark.parametrize("connections", [1, 3])
def test_pull_copies_every_layer_of_random_blocks(
    layout: KVLayout,
    listening_peer: tuple[Peer, str], connections: int, seeded_pool: SeededPool
) -> None:
    _, address = listening_peer
    source = seeded_pool(layout, 7)
    transport, pool = _decode(layout, connections=connections)
    rng = random.Random(connections)
    try:
        session = transport.connect(address, timeout=WAIT_S)
        src = rng.sample(range(layout.num_blocks), 20) + list(range(30, 40))  # random ids and one long run
        dst = rng.sample(range(layout.num_blocks), 30)
        session.pull(src, dst).wait(WAIT_S)
        assert torch.equal(pool[:, dst], source[:, src])
        untouched = sorted(set(range(layout.num_blocks)) - set(dst))
        assert not pool[:, untouched].any()
        assert session.bytes_received == len(src) * layout.num_layers * layout.block_bytes
    finally:
        transport.close()


def test_pull_of_blocks_out_of_the_peer_range_is_rejected(layout: KVLayout, listening_peer: tuple[Peer, str]) -> None:
    _, address = listening_peer
    transport, _ = _decode(layout)
    try:
        session = transport.connect(address, timeout=WAIT_S)
        with pytest.raises(ValueError, match="source blocks"):
            session.pull([layout.num_blocks], [0])
    finally:
        transport.close()


def test_push_layer_by_layer_lands_in_the_decode_pool(
    layout: KVLayout,
    peer_factory: Callable[..., Peer], tmp_path: Path, seeded_pool: SeededPool
) -> None:
    prefill_pool = seeded_pool(layout, 11)
    prefill = create_transport("tcp", prefill_pool, layout, "prefill-1", "127.0.0.1:2")
    try:
        address = prefill.start("127.0.0.1", 0)
        decode = peer_factory("connect", layout, "decode-1", "--address", address, "--connections", "3")
        assert decode.first_line == "linked prefill-1"
        session = prefill.session("decode-1", timeout=WAIT_S)
        rng = random.Random(5)
        src = list(range(3, 13)) + rng.sample(range(13, layout.num_blocks), 15)
        dst = list(range(20, 30)) + rng.sample([b for b in range(layout.num_blocks) if not 20 <= b < 30], 15)
        handles = [session.push(layer, src, dst) for layer in range(layout.num_layers)]
        session.flush(WAIT_S)
        assert all(h.done() for h in handles)
        received = decode.dump(tmp_path / "decode.pt")
        assert torch.equal(received[:, dst], prefill_pool[:, src])
        assert not received[:, sorted(set(range(layout.num_blocks)) - set(dst))].any()
        assert session.bytes_sent == len(src) * layout.num_layers * layout.block_bytes
    finally:
        prefill.close()


def test_waits_are_bounded_and_a_lost_peer_fails_transfers(
    layout: KVLayout,
    peer_factory: Callable[..., Peer], seeded_pool: SeededPool
) -> None:
    prefill = create_transport("tcp", seeded_pool(layout, 3), layout, "prefill-2", "127.0.0.1:3")
    try:
        address = prefill.start("127.0.0.1", 0)
        decode = peer_factory("connect", layout, "decode-2", "--address", address)
        session = prefill.session("decode-2", timeout=WAIT_S)
        with pytest.raises(TransferTimeout):
            prefill.session("nobody", timeout=0.2)
        decode.pause()  # a decode that stops answering
        try:
            handle = session.push(0, [0, 1], [5, 6])
            with pytest.raises(TransferTimeout):
                handle.wait(0.5)
        finally:
            decode.resume()
        handle.wait(WAIT_S)
        decode.stop()
        deadline = time.monotonic() + WAIT_S
        while session.is_open and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not session.is_open
        with pytest.raises(TransferError, match="closed|lost"):
            session.push(1, [0], [0]).wait(WAIT_S)
        assert prefill.peers() == {}
    finally:
        prefill.close()


def test_connect_to_a_silent_server_times_out(layout: KVLayout) -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    transport, _ = _decode(layout)
    try:
        with pytest.raises(TransferTimeout):
            transport.connect("127.0.0.1:%d" % silent.getsockname()[1], timeout=0.3)
    finally:
        transport.close()
        silent.close()


def test_dropping_a_cut_off_peers_bytes_ends_quietly_on_a_socket_closed_by_another_thread() -> None:
    """A session closing while its sender lingers after an ERROR frame closes the socket under
    it. The linger then ends there: select refused the closed socket's fd (-1) with ValueError,
    which killed the sender thread with a traceback in CI."""
    ours, peer = socket.socketpair()
    peer.send(b"x" * 1024)  # unread: a linger on an open socket would read it
    ours.close()  # as a session's close() does on another thread, mid-linger
    began = time.monotonic()
    try:
        drop_until_quiet(ours, began + 10.0)
    finally:
        peer.close()
    assert time.monotonic() - began < 5.0
