"""The CPU paged decode kernel alone (csrc/paged_decode.c; a script, not a test).

A decode step's attention of a model shaped like the embedded default
(SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64) over
`--batch` sequences of `--context` tokens in blocks of 16, each layer's cache
its own tensor and each sequence's blocks shuffled through it, as a worker's
pool ends up after requests come and go. Prints ms per step (30 layer calls)
and the cache bytes read per second, for fp32 and bf16 caches:

    .venv/bin/python benchmarks/bench_attention.py [--batch 8 32] [--context 330] [--threads 2]

`--against REV` also builds the kernel as it was at git revision REV and
times the two in turn, step by step, on the same caches: on a machine whose
speed moves within minutes, only such side-by-side figures compare.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.workers.engine import cpu_attention, cpu_kernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
KERNEL_FILES = ("paged_decode.c", "vector.h")
Step = Callable[[], None]


def build_at(rev: str, out_dir: Path, files: tuple[str, ...] = KERNEL_FILES) -> ctypes.CDLL:
    """A kernel's library built from its sources at git revision `rev` (the first of `files`
    compiled, the others its headers), with the engine's flags."""
    root = Path(__file__).resolve().parents[1]
    for name in files:
        source = subprocess.run(["git", "show", f"{rev}:workers/engine/csrc/{name}"], cwd=root, check=True,
                                capture_output=True, text=True, timeout=30).stdout
        (out_dir / name).write_text(source)
    library = out_dir / f"{Path(files[0]).stem}.so"
    subprocess.run([os.environ.get("CC", "cc"), *cpu_kernels.FLAGS, "-o", str(library), str(out_dir / files[0])],
                   check=True, capture_output=True, text=True, timeout=180)
    return ctypes.CDLL(str(library))


def steps_for(batch: int, context: int, dtype: torch.dtype, baseline: ctypes.CDLL | None) -> dict[str, Step]:
    """A decode step's 30 layer calls over shuffled blocks: this tree's kernel, and the baseline's
    (its C function called with the arguments the engine's wrapper passes) when given."""
    blocks_per_seq = -(-context // BLOCK)
    caches = [torch.randn(batch * blocks_per_seq, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(batch * blocks_per_seq).to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)

    def step() -> None:
        for cache in caches:
            cpu_attention.paged_decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5)
    steps = {"this tree": step}
    if baseline is not None:
        kernel = getattr(baseline, f"paged_decode_{cpu_kernels.DTYPE_SUFFIXES[dtype]}")
        kernel.argtypes, kernel.restype = cpu_attention.ARGTYPES, ctypes.c_int
        query, out = q.float().contiguous(), torch.empty(q.shape)
        table_p = ctypes.cast(tables.data_ptr(), cpu_attention.INT32_P)
        lens_p = ctypes.cast(lens.data_ptr(), cpu_attention.INT32_P)

        def baseline_step() -> None:
            for cache in caches:
                kernel(query.data_ptr(), cache.data_ptr(), table_p, lens_p, out.data_ptr(), batch, HEADS, KV_HEADS,
                       HEAD_DIM, BLOCK, blocks_per_seq, HEAD_DIM ** -0.5, torch.get_num_threads())
                out.to(dtype)  # the wrapper's conversion back, as in this tree's step
        steps["baseline"] = baseline_step
    return steps


def median_ms(steps: dict[str, Step], rounds: int) -> dict[str, float]:
    """Each step timed once per round, in turn; the median of its rounds in ms."""
    for step in steps.values():
        step()  # builds this tree's kernels on first use, warms the caches
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, default=330, help="tokens per sequence (default: 330, mid-way "
                   "through the peers benchmark's 256 in + 128 out)")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each kernel (default: 5)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--against", metavar="REV", help="also time the kernel at this git revision, in turn")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.is_available():
        print("the paged decode kernel is not available here (no C compiler, or switched off)")
        return 1
    print(f"{args.threads} threads, context {args.context}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_at(args.against, Path(tmp)) if args.against else None
        against = f" | {args.against}, ms per step | speed-up" if baseline else ""
        print(f"| cache | batch | ms per step (30 layers) | cache read GB/s{against} |")
        print("|---|---:|---:|---:|" + ("---:|---:|" if baseline else ""))
        for dtype in (torch.float32, torch.bfloat16):
            for batch in args.batch:
                ms = median_ms(steps_for(batch, args.context, dtype, baseline), args.steps)
                read = LAYERS * batch * args.context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
                cells = [f"{ms['this tree']:.1f}", f"{read / ms['this tree'] / 1e6:.1f}"]
                if baseline:
                    cells += [f"{ms['baseline']:.1f}", f"{ms['baseline'] / ms['this tree']:.2f}x"]
                print(f"| {str(dtype).removeprefix('torch.')} | {batch} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
