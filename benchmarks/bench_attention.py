"""The CPU paged decode kernel alone (csrc/paged_decode.c; a script, not a test).

A decode step's attention of a model shaped like the embedded default
(SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64) over
`--batch` sequences of `--context` tokens in blocks of 16, each layer's cache
its own tensor and each sequence's blocks shuffled through it, as a worker's
pool ends up after requests come and go. Prints ms per step (30 layer calls)
and the cache bytes read per second, for fp32 and bf16 caches:

    .venv/bin/python benchmarks/bench_attention.py [--batch 8 32] [--context 330] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from disagg.workers.engine import cpu_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_ms(batch: int, context: int, dtype: torch.dtype, steps: int) -> float:
    blocks_per_seq = -(-context // BLOCK)
    caches = [torch.randn(batch * blocks_per_seq, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(batch * blocks_per_seq).to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)

    def step() -> None:
        for cache in caches:
            cpu_attention.paged_decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5)

    step()  # builds the kernels on first use
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, default=330, help="tokens per sequence (default: 330, mid-way "
                   "through the peers benchmark's 256 in + 128 out)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.is_available():
        print("the paged decode kernel is not available here (no C compiler, or switched off)")
        return 1
    print(f"{args.threads} threads, context {args.context}, load average {os.getloadavg()[0]:.2f}")
    print("| cache | batch | ms per step (30 layers) | cache read GB/s |\n|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batch:
            ms = step_ms(batch, args.context, dtype, args.steps)
            read = LAYERS * batch * args.context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {ms:.1f} | {read / ms / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
