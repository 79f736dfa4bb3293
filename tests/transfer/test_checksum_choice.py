"""Which payload checksum a link negotiates: none where it buys nothing, a real one elsewhere."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable

import pytest
import torch

from disagg.workers.transfer import KVLayout, KVTransport, PeerInfo
from disagg.workers.transfer.handshake import Hello, initiate
from disagg.workers.transfer.tcp import TcpSession
from disagg.workers.transfer.wire import ChecksumKind, checksum_preference, supported_checksums

WAIT_S = 30.0


@pytest.mark.parametrize(
    ("peer_host", "tls", "unchecked_first"),
    [("127.0.0.1", False, True), ("127.3.2.1", False, True), ("::1", False, True),
     ("::ffff:127.0.0.1", False, True), ("10.0.0.5", False, False), ("fd00::5", False, False),
     ("10.0.0.5", True, True)],
)
def test_unchecked_comes_first_only_on_loopback_or_tls(peer_host: str, tls: bool, unchecked_first: bool) -> None:
    checked = supported_checksums()
    assert checked and ChecksumKind.NONE not in checked
    expected = [ChecksumKind.NONE, *checked] if unchecked_first else [*checked, ChecksumKind.NONE]
    assert checksum_preference(peer_host, tls) == expected


def negotiated(acceptor: KVTransport, offered: list[ChecksumKind], layout: KVLayout) -> ChecksumKind:
    """The kind `acceptor` picks for a link from loopback that offers `offered`."""
    host, port = acceptor.start("127.0.0.1", 0).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        me = PeerInfo(f"decode-{uuid.uuid4().hex[:6]}", "127.0.0.1:9", layout)
        reply, _ = initiate(sock, Hello(me, "tcp", uuid.uuid4().hex, 0, 1, [int(k) for k in offered]), None,
                            time.monotonic() + WAIT_S)
        assert reply.ok, reply.reason
        return ChecksumKind(reply.checksum)


@pytest.mark.parametrize(
    ("accepted", "offered", "expected"),
    [
        (None, [*supported_checksums(), ChecksumKind.NONE], ChecksumKind.NONE),  # both by default, on loopback
        (None, supported_checksums(), supported_checksums()[0]),  # a peer that insists on checking
        ([ChecksumKind.XXH3], [*supported_checksums(), ChecksumKind.NONE], ChecksumKind.XXH3),  # forced here
    ],
)
def test_the_acceptor_picks_by_its_policy_among_what_is_offered(
    transport_factory: Callable[..., KVTransport], layout: KVLayout,
    accepted: list[ChecksumKind] | None, offered: list[ChecksumKind], expected: ChecksumKind,
) -> None:
    prefill = transport_factory("tcp", torch.zeros(layout.shape, dtype=layout.torch_dtype), layout, "prefill",
                                checksums=accepted)
    assert negotiated(prefill, offered, layout) == expected


def test_a_default_link_on_loopback_moves_exact_bytes_unchecked(
    transport_factory: Callable[..., KVTransport], layout: KVLayout,
    seeded_pool: Callable[[KVLayout, int], torch.Tensor],
) -> None:
    source = seeded_pool(layout, 7)
    prefill = transport_factory("tcp", source, layout, "prefill")
    target = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    decode = transport_factory("tcp", target, layout, "decode")
    session = decode.connect(prefill.start("127.0.0.1", 0), timeout=WAIT_S)
    assert isinstance(session, TcpSession) and session.checksum == ChecksumKind.NONE
    session.pull([5, 6, 9], [0, 1, 2])
    session.flush(WAIT_S)
    assert torch.equal(target[:, 0:3], source[:, [5, 6, 9]])
