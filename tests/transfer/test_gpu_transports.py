"""cuda_ipc, nccl and tcp from GPU memory, between real processes (need CUDA)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.workers.transfer import KVLayout, create_transport

WAIT_S = 60.0
Peer = Any  # conftest.Peer
SeededPool = Callable[[KVLayout, int], torch.Tensor]


@pytest.mark.parametrize("name", ["cuda_ipc", "nccl"])
def test_gpu_transports_refuse_a_cpu_pool(layout: KVLayout, name: str) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        create_transport(name, torch.zeros(layout.shape, dtype=layout.torch_dtype), layout, "w", "w")


def _needs(transport: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot pair two ranks on one GPU: needs 2 GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["tcp", "cuda_ipc", "nccl"])
def test_push_and_pull_between_gpu_pools(
    layout: KVLayout, transport: str, peer_factory: Callable[..., Peer], seeded_pool: SeededPool, tmp_path: Path
) -> None:
    _needs(transport)
    # This process is the prefill on cuda:0; the peer is the decode (cuda:1 for nccl).
    peer_device = "cuda:1" if transport == "nccl" else "cuda:0"
    source = seeded_pool(layout, 13).to("cuda:0")
    prefill = create_transport(transport, source, layout, "prefill-g", "prefill-g")
    try:
        address = prefill.start("127.0.0.1", 0)
        decode = peer_factory("connect", layout, "decode-g", "--address", address, "--transport", transport,
                              "--device", peer_device, "--seed", "0")
        assert decode.first_line == "linked prefill-g"
        session = prefill.session("decode-g", timeout=WAIT_S)
        rng = random.Random(1)
        src, dst = rng.sample(range(layout.num_blocks), 20), rng.sample(range(layout.num_blocks), 20)
        for layer in range(layout.num_layers):
            session.push(layer, src, dst)
        session.flush(WAIT_S)
        received = decode.dump(tmp_path / "decode.pt")
        assert torch.equal(received[:, dst], source[:, src].cpu())
    finally:
        prefill.close()


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["tcp", "cuda_ipc", "nccl"])
def test_pull_from_a_gpu_peer(
    layout: KVLayout, transport: str, peer_factory: Callable[..., Peer], seeded_pool: SeededPool
) -> None:
    _needs(transport)
    peer_device = "cuda:1" if transport == "nccl" else "cuda:0"
    prefill = peer_factory("listen", layout, "prefill-h", "--transport", transport, "--device", peer_device,
                           "--seed", "17")
    kind, address = prefill.first_line.split()
    assert kind == "ready"
    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype, device="cuda:0")
    decode = create_transport(transport, pool, layout, "decode-h", "decode-h")
    try:
        session = decode.connect(address, timeout=WAIT_S)
        rng = random.Random(2)
        src, dst = rng.sample(range(layout.num_blocks), 25), rng.sample(range(layout.num_blocks), 25)
        session.pull(src, dst).wait(WAIT_S)
        assert torch.equal(pool[:, dst].cpu(), seeded_pool(layout, 17)[:, src])
    finally:
        decode.close()
