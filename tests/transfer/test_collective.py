"""The `nccl` transport's rendezvous and frame-ordered payload, run over Gloo on CPU pools.

NCCL itself needs two GPUs (test_gpu_transports.py); everything around the
communicator (the TCPStore hosted in the handshake, ranks, frames on the link's
socket with payloads on the process group) is the same code here, in two real
processes on 127.0.0.1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.workers.transfer import KVLayout, KVTransport, LinkRefusedError, TransferError, TransferHandle, TransferSession
from disagg.workers.transfer.base import BlockRun

WAIT_S = 60.0
Peer = Any  # conftest.Peer
SeededPool = Callable[[KVLayout, int], torch.Tensor]
TransportFactory = Callable[..., KVTransport]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


Link = tuple[torch.Tensor, TransferSession, Peer]  # (this side's pool, its session, the decode peer)


@pytest.fixture
def gloo_link(
    layout: KVLayout, peer_factory: Callable[..., Peer], transport_factory: TransportFactory,
    seeded_pool: SeededPool,
) -> Callable[[int], Link]:
    """This process as the prefill over the pool of a seed; a decode peer process (zero pool) links to it."""

    def link(seed: int) -> Link:
        source = seeded_pool(layout, seed)
        prefill = transport_factory("gloo", source, layout, "prefill")
        address = prefill.start("127.0.0.1", 0)
        decode = peer_factory("connect", layout, "decode", "--address", address, "--transport", "gloo")
        assert decode.first_line == "linked prefill"
        return source, prefill.session("decode", timeout=WAIT_S), decode

    return link


def test_push_every_layer_lands_in_the_peer_pool(layout: KVLayout, gloo_link: Callable[[int], Link],
                                                 tmp_path: Path) -> None:
    source, session, decode = gloo_link(21)
    rng = random.Random(3)
    for _ in range(2):  # two requests over one communicator: frames and sends stay paired
        src, dst = rng.sample(range(layout.num_blocks), 17), rng.sample(range(layout.num_blocks), 17)
        for layer in range(layout.num_layers):
            session.push(layer, src, dst)
        session.flush(WAIT_S)
        received = decode.dump(tmp_path / "decode.pt")
        assert torch.equal(received[:, dst], source[:, src])
    assert session.bytes_sent == 2 * 17 * layout.num_layers * layout.block_bytes


def test_pull_reads_every_layer_from_the_peer(
    layout: KVLayout, peer_factory: Callable[..., Peer], transport_factory: TransportFactory,
    seeded_pool: SeededPool,
) -> None:
    prefill = peer_factory("listen", layout, "prefill-d", "--transport", "gloo", "--seed", "23")
    kind, address = prefill.first_line.split()
    assert kind == "ready"
    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    decode = transport_factory("gloo", pool, layout, "decode-d")
    session = decode.connect(address, timeout=WAIT_S)
    src, dst = list(range(5, 30)), random.Random(4).sample(range(layout.num_blocks), 25)
    session.pull(src, dst).wait(WAIT_S)
    assert torch.equal(pool[:, dst], seeded_pool(layout, 23)[:, src])
    untouched = sorted(set(range(layout.num_blocks)) - set(dst))
    assert not pool[:, untouched].any()


def test_a_link_with_a_different_layout_is_refused(
    layout: KVLayout, peer_factory: Callable[..., Peer], transport_factory: TransportFactory,
) -> None:
    prefill = peer_factory("listen", layout, "prefill-e", "--transport", "gloo")
    _, address = prefill.first_line.split()
    other = replace(layout, block_size=layout.block_size * 2)
    decode = transport_factory("gloo", torch.zeros(other.shape, dtype=other.torch_dtype), other, "decode-e")
    with pytest.raises(LinkRefusedError, match="block_size"):
        decode.connect(address, timeout=WAIT_S)


def test_a_refused_frame_keeps_the_link_in_step(layout: KVLayout, gloo_link: Callable[[int], Link],
                                                tmp_path: Path) -> None:
    # A peer that skips the range check (a bug, another version) sends runs past the pool's end:
    # the receiver must take that payload off the communicator, or every later frame is misread.
    source, session, decode = gloo_link(29)
    refused = TransferHandle(1, 0)
    connection = session._conns[0]  # type: ignore[attr-defined]  # below the session's own range check
    connection.submit_write(0, [BlockRun(0, layout.num_blocks - 2, 5)], refused, None)
    with pytest.raises(TransferError, match="dst blocks .* out of range"):
        refused.wait(WAIT_S)
    src, dst = [3, 4, 9], [40, 1, 2]
    for layer in range(layout.num_layers):
        session.push(layer, src, dst)
    session.flush(WAIT_S)
    assert torch.equal(decode.dump(tmp_path / "decode.pt")[:, dst], source[:, src])
    assert session.is_open
