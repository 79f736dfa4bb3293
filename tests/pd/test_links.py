"""The peer table over real tcp transfer sessions on loopback: a peer that links again keeps its new session."""

from __future__ import annotations

import asyncio

import torch

from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.links import PeerTable
from disagg.workers.transfer import KVLayout, create_transport

LAYOUT = KVLayout("test-model", "float16", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
WAIT_S = 10.0


def test_a_broken_sessions_removal_spares_the_peers_new_session() -> None:
    """The watcher removes a peer whose session broke; if the peer linked again meanwhile (a restarted
    worker keeps its name), the removal of the broken session must not drop the new one."""
    prefill = create_transport("tcp", torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype), LAYOUT, "prefill-0",
                               "127.0.0.1:1")
    decode = create_transport("tcp", torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype), LAYOUT, "decode-0",
                              "127.0.0.1:2")
    lost: list[str] = []

    async def on_lost(name: str, reason: str) -> None:
        lost.append(name)

    async def run() -> None:
        table = PeerTable(WorkerMetrics("decode"), on_lost)
        address = prefill.start("127.0.0.1", 0)
        broken = decode.connect(address, WAIT_S)
        table.add("prefill-0", broken)
        broken.close()
        relinked = decode.connect(address, WAIT_S)
        table.add("prefill-0", relinked)
        assert not await table.remove("prefill-0", "its session broke", only=broken)
        assert table.is_live("prefill-0") and table.get("prefill-0") is relinked and lost == []
        assert await table.remove("prefill-0", "unlinked")
        assert "prefill-0" not in table and lost == ["prefill-0"] and not relinked.is_open

    try:
        asyncio.run(run())
    finally:
        decode.close()
        prefill.close()
