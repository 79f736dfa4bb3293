"""float32 projections: our panel kernel against oneDNN's packed linear, by row count (a script, not a test).

The shapes are the embedded default's (SmolLM2-135M: hidden 576, 9 + 2 x 3
heads of 64, MLP 1536, vocabulary 49152); each is timed with both kernels in
alternating order over several rounds, on random weights, and the medians are
printed as GFLOP/s with the ratio panels / oneDNN. It is how models/panels.py
was chosen over oneDNN on this kind of CPU. The largest weight (the output
projection, 113 MB) streams from memory; the others fit in the last-level
cache, so their figures are the kernels' arithmetic, not a decode step's.

    .venv/bin/python benchmarks/bench_linear.py [--rows 1 8 32 256 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.models import panels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    if cpu_kernels.library() is None:
        print("the panel kernel is not built here: no C compiler (see cpu_kernels.py)", file=sys.stderr)
        return 1
    if not panels.preferred():
        print("note: the engine does not take the panel kernel on this CPU (see models/panels.py)")
    torch.set_num_threads(args.threads)
    print(f"command: {' '.join(sys.orig_argv)}")
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; GFLOP/s, medians of "
          f"{args.rounds} alternating rounds\n")
    print("| rows | " + " | ".join(f"{name} panels / oneDNN" for name in SHAPES) + " |")
    print("|---:|" + "---:|" * len(SHAPES))
    weights = {name: torch.randn(n, k) for name, (n, k) in SHAPES.items()}
    packed = {name: (panels.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)) for name, w in weights.items()}
    for rows in args.rows:
        cells = []
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k)
            in_panels, in_onednn = packed[name]
            kernels = {"panels": lambda: panels.panel_linear(x, in_panels, n, None),
                       "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, in_onednn, None, "none", [], "")}
            calls = max(1, int(2e8 / (rows * n * k)))  # about 0.4 GFLOP a timing
            times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
            for round_ in range(args.rounds):
                for kernel in (list(kernels) if round_ % 2 == 0 else list(reversed(kernels))):
                    kernels[kernel]()  # warm
                    times[kernel].append(seconds_per_call(kernels[kernel], calls))
            gflops = {kernel: 2 * rows * n * k / statistics.median(t) / 1e9 for kernel, t in times.items()}
            cells.append(f"{gflops['panels']:.0f} / {gflops['oneDNN']:.0f} ({gflops['panels'] / gflops['oneDNN']:.2f}x)")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
