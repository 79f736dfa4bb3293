"""Decode steps with projections from grid codes against the dtype's own, by batch size (a script, not a test).

One engine on the embedded default (its decoder weights sit on a Q4_1 grid,
its tied embedding and output projection on a Q8_0 grid); for each batch size,
that many requests of random prompts are prefilled, then decode steps
alternate between the codes and the model dtype's weights (float32 in panels,
or bf16 in oneDNN's layout) for the weights of one grid
(models.packing.GRID_MAX_ROWS switched in this process, rounds in alternating
order) and the medians are printed. It is how GRID_MAX_ROWS was chosen: the
codes must win where they are used.

    .venv/bin/python benchmarks/bench_grid_rows.py [--format Q4_1|Q8_0] [--dtype float32|bfloat16]
        [--batch-sizes 1 4 8 12 16] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.models import grids, packing
from disagg.workers.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 320
STEPS_PER_ROUND = 4


def step_ms(engine: LLMEngine, grid: grids.GridFormat, max_rows: int) -> float:
    packing.GRID_MAX_ROWS[grid, engine.config.torch_dtype] = max_rows
    start = time.perf_counter()
    for _ in range(STEPS_PER_ROUND):
        engine.step()
    return (time.perf_counter() - start) / STEPS_PER_ROUND * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--format", choices=[f.name for f in grids.GridFormat], default="Q4_1",
                   help="the grid whose weights switch between codes and the dtype's own")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 12, 16])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    grid = grids.GridFormat[args.format]
    torch.set_num_threads(args.threads)
    most = max(args.batch_sizes)
    tokens = PROMPT_TOKENS + 2 * args.rounds * STEPS_PER_ROUND + 8
    engine = LLMEngine.from_config(EngineConfig(
        model="builtin:smollm2-135m", device="cpu", dtype=args.dtype, block_size=16,
        num_kv_blocks=most * (tokens // 16 + 2), max_num_seqs=most, max_model_len=tokens + 1,
        enable_prefix_caching=False))
    rng = random.Random(0)
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; {grid.name} weights switched\n")
    print(f"| batch | {grid.name} codes (ms/step) | {args.dtype} (ms/step) | {args.dtype} / codes |\n|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        params = SamplingParams(temperature=0.0, max_tokens=tokens - PROMPT_TOKENS, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)], params)
        while engine.num_waiting or any(r.num_computed_tokens < PROMPT_TOKENS for r in engine.scheduler.running):
            engine.step()
        times: dict[str, list[float]] = {"codes": [], "own": []}
        for round_ in range(args.rounds):
            order = ("codes", "own") if round_ % 2 == 0 else ("own", "codes")
            for path in order:
                times[path].append(step_ms(engine, grid, max_rows=batch if path == "codes" else 0))
        codes_ms, own_ms = statistics.median(times["codes"]), statistics.median(times["own"])
        print(f"| {batch} | {codes_ms:.1f} | {own_ms:.1f} | {own_ms / codes_ms:.2f}x |", flush=True)
        for request in list(engine.scheduler.running):
            engine.abort_request(request.request_id)
        engine.step()
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
