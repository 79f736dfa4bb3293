"""GPU check of the KV transports (a script to run on a CUDA machine, not a test).

Prints, for one request's blocks of every layer:
- cuda_ipc push bandwidth between two processes against a device-to-device
  copy of the same runs in one process (ratio),
- tcp push bandwidth from GPU memory (through pinned staging) between two processes,
- nccl push bandwidth when two GPUs exist (else the reason it is skipped).

    .venv/bin/python benchmarks/gpu_check_transfer.py [--layers 24] [--block-size 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from disagg.workers.transfer import KVLayout, create_transport
from disagg.workers.transfer.base import merge_runs

WAIT_S = 120.0


def median_seconds(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: first touch, lazy communicator set-up
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def child(layout: KVLayout, transport: str, address: str, device: str) -> None:
    """The decode: links to `address` and stays until stdin closes."""
    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device)
    link = create_transport(transport, pool, layout, "gpu-decode", "gpu-decode")
    link.connect(address, timeout=WAIT_S)
    print("linked", flush=True)
    sys.stdin.read()
    link.close()


def push_seconds(layout: KVLayout, transport: str, source: torch.Tensor, pairs: tuple[list[int], list[int]],
                 peer_device: str, repeats: int) -> float:
    prefill = create_transport(transport, source, layout, "gpu-prefill", "gpu-prefill")
    address = prefill.start("127.0.0.1", 0)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", transport, "--address", address, "--device", peer_device,
         "--layout", json.dumps(layout.to_dict())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "linked", "decode failed to link"
        session = prefill.session("gpu-decode", timeout=WAIT_S)

        def run() -> None:
            for layer in range(layout.num_layers):
                session.push(layer, *pairs)
            session.flush(WAIT_S)

        return median_seconds(run, repeats)
    finally:
        assert proc.stdin is not None, "stdin is piped"
        proc.stdin.close()
        proc.wait(30)
        prefill.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(KVLayout.from_dict(json.loads(args.layout)), args.child, args.address, args.device)
        return
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    layout = KVLayout("gpu-check", "float16", args.layers, 2 * args.blocks, args.block_size, 8, 128)
    rng = random.Random(0)
    pairs = (rng.sample(range(layout.num_blocks), args.blocks), rng.sample(range(layout.num_blocks), args.blocks))
    runs = merge_runs(*pairs)
    nbytes = layout.num_layers * args.blocks * layout.block_bytes
    source = torch.randn(layout.shape, device="cuda:0").to(layout.torch_dtype)
    target = torch.zeros_like(source)

    def d2d() -> None:
        for layer in range(layout.num_layers):
            for r in runs:
                target[layer, r.dst : r.dst + r.count].copy_(source[layer, r.src : r.src + r.count])

    print(f"{torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s); {layout.num_layers} layers x "
          f"{args.blocks} blocks of {layout.block_bytes >> 10} KiB = {nbytes / 2**20:.0f} MiB per request")
    base = nbytes / median_seconds(d2d, args.repeats) / 1e9
    print(f"  device-to-device copy_ (same runs)  {base:8.2f} GB/s")
    for transport, device in [("cuda_ipc", "cuda:0"), ("tcp", "cuda:0"), ("nccl", "cuda:1")]:
        if transport == "nccl" and torch.cuda.device_count() < 2:
            print("  nccl: skipped, NCCL cannot pair two ranks on one GPU (needs 2 GPUs)")
            continue
        rate = nbytes / push_seconds(layout, transport, source, pairs, device, args.repeats) / 1e9
        print(f"  {transport:8s} push, 2 processes        {rate:8.2f} GB/s  {rate / base:5.2f}x device copy")


if __name__ == "__main__":
    main()
