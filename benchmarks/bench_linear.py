"""Projections: our panel kernels against oneDNN's packed linear, by row count (a script, not a test).

The shapes are the embedded default's (SmolLM2-135M: hidden 576, 9 + 2 x 3
heads of 64, MLP 1536, vocabulary 49152); each is timed with both kernels in
alternating order over several rounds, on random weights, and the medians are
printed as GFLOP/s with the ratio panels / oneDNN. It is how models/panels.py
was chosen over oneDNN on this kind of CPU. The largest weight (the output
projection, 113 MB) streams from memory; the others fit in the last-level
cache, so their figures are the kernels' arithmetic, not a decode step's.

    .venv/bin/python benchmarks/bench_linear.py [--dtype bfloat16] [--rows 1 8 32 256 2048] [--rounds 5]

--stream times instead one decode step's worth of them: every weight of 30
layers and the output projection once each (270 MB in bf16, 540 in float32),
so that the weights come from memory as in a step, and prints GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping

import torch

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.models import panels

LAYERS = 30  # the embedded default's
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def alternating_medians(kernels: Mapping[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Seconds per call of each kernel, medians of `rounds` rounds in alternating order."""
    times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
    for round_ in range(rounds):
        for kernel in (list(kernels) if round_ % 2 == 0 else list(kernels)[::-1]):
            kernels[kernel]()  # warm
            times[kernel].append(seconds_per_call(kernels[kernel], calls))
    return {kernel: statistics.median(t) for kernel, t in times.items()}


PanelLinear = Callable[[torch.Tensor], torch.Tensor]


def both_packings(weight: torch.Tensor) -> tuple[PanelLinear, torch.Tensor]:
    """(x -> x @ weight.T by our panel kernel, oneDNN's packed copy). A bf16 kernel reads oneDNN's
    copy, as the engine's PackedLinear does (in the panels' width oneDNN chose here)."""
    in_onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    n = weight.shape[0]
    found = panels.onednn_panels(weight, in_onednn)
    if found is not None:
        return lambda x: panels.panel_linear_at(x, found, n, None), in_onednn
    in_panels = panels.pack(weight)
    return lambda x: panels.panel_linear(x, in_panels, n, None), in_onednn


def by_shape(args: argparse.Namespace) -> None:
    print("| rows | " + " | ".join(f"{name} panels / oneDNN" for name in SHAPES) + " |")
    print("|---:|" + "---:|" * len(SHAPES))
    weights = {name: torch.randn(n, k).to(args.dtype) for name, (n, k) in SHAPES.items()}
    packed = {name: both_packings(w) for name, w in weights.items()}
    for rows in args.rows:
        cells = []
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k).to(args.dtype)
            in_panels, in_onednn = packed[name]
            kernels = {"panels": lambda: in_panels(x),
                       "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, in_onednn, None, "none", [], "")}
            calls = max(1, int(2e8 / (rows * n * k)))  # about 0.4 GFLOP a timing
            gflops = {kernel: 2 * rows * n * k / t / 1e9
                      for kernel, t in alternating_medians(kernels, calls, args.rounds).items()}
            cells.append(f"{gflops['panels']:.0f} / {gflops['oneDNN']:.0f} ({gflops['panels'] / gflops['oneDNN']:.2f}x)")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def streamed(args: argparse.Namespace) -> None:
    print("| rows | panels GB/s | oneDNN GB/s | panels / oneDNN |")
    print("|---:|---:|---:|---:|")
    layer = [shape for name, shape in SHAPES.items() if name != "lm_head"]
    weights = [torch.randn(n, k).to(args.dtype) for _ in range(LAYERS) for n, k in layer]
    weights.append(torch.randn(*SHAPES["lm_head"]).to(args.dtype))
    in_panels, in_onednn = zip(*map(both_packings, weights))
    step_bytes = sum(w.numel() * w.element_size() for w in weights)
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(args.dtype) for k in {w.shape[1] for w in weights}}
        kernels = {
            "panels": lambda: [p(xs[w.shape[1]]) for w, p in zip(weights, in_panels)],
            "oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], o, None, "none", [], "")
                               for w, o in zip(weights, in_onednn)]}
        gbs = {kernel: step_bytes / t / 1e9 for kernel, t in alternating_medians(kernels, 1, args.rounds).items()}
        print(f"| {rows} | {gbs['panels']:.1f} | {gbs['oneDNN']:.1f} | {gbs['panels'] / gbs['oneDNN']:.2f}x |",
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--stream", action="store_true", help="one decode step's weights once each (see above)")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if cpu_kernels.library() is None:
        print("the panel kernel is not built here: no C compiler (see cpu_kernels.py)", file=sys.stderr)
        return 1
    if not panels.preferred(args.dtype):
        print(f"note: the engine does not take the panel kernel for {args.dtype} on this CPU (see models/panels.py)")
        if args.dtype == torch.bfloat16:
            return 1  # the bf16 kernels need AMX or AVX-512 BF16: nothing to time
    torch.set_num_threads(args.threads)
    print(f"command: {' '.join(sys.orig_argv)}")
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; "
          f"{'GB/s of weights' if args.stream else 'GFLOP/s'}, medians of {args.rounds} alternating rounds\n")
    (streamed if args.stream else by_shape)(args)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
