"""The gated MLP's SiLU x up kernel alone (csrc/silu_mul.c), this tree against a git revision
(a script, not a test).

Rows of [gate | up] of the embedded default's width (intermediate 1536): one row
(a decode of one), 32 (a decode batch) and 2048 (a prefill step of 8 x 256 tokens),
in float32 and bfloat16. The two builds are timed in turn, call by call, on the same
input, and their outputs compared bit for bit:

    .venv/bin/python benchmarks/bench_silu_mul.py --against REV [--rows 1 32 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
from functools import partial
from pathlib import Path

import torch

from bench_attention import build_at, median_ms

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.models import cpu_fused

WIDTH = 1536
KERNEL_FILES = ("silu_mul.c", "vector.h")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", metavar="REV", required=True, help="the git revision to time in turn")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 2048])
    p.add_argument("--calls", type=int, default=40, help="timed calls of each build (default: 40)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, width {WIDTH}, load average {os.getloadavg()[0]:.2f}")
    print(f"| dtype | rows | this tree, ms | {args.against}, ms | speed-up | same bits |\n|---|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_at(args.against, Path(tmp), KERNEL_FILES)
        for dtype in (torch.float32, torch.bfloat16):
            suffix = cpu_kernels.DTYPE_SUFFIXES[dtype]
            kernels = {"this tree": cpu_fused.silu_mul_kernel(dtype), "baseline": getattr(baseline, f"silu_mul_{suffix}")}
            if kernels["this tree"] is None:
                print("the CPU kernels are not available here (no C compiler, or switched off)")
                return 1
            for rows in args.rows:
                gate_up = torch.randn(rows, 2 * WIDTH).to(dtype)
                outs = {name: torch.empty(rows, WIDTH, dtype=dtype) for name in kernels}

                def call(name: str) -> None:
                    kernels[name](ctypes.c_void_p(gate_up.data_ptr()), ctypes.c_void_p(outs[name].data_ptr()),
                                  rows, WIDTH, args.threads)

                ms = median_ms({name: partial(call, name) for name in kernels}, args.calls)
                same = "yes" if torch.equal(outs["this tree"], outs["baseline"]) else "no"
                print(f"| {suffix} | {rows} | {ms['this tree']:.4f} | {ms['baseline']:.4f} "
                      f"| {ms['baseline'] / ms['this tree']:.2f}x | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
