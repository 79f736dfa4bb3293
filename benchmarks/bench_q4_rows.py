"""Decode steps with projections from 4-bit codes against float32, by batch size (a script, not a test).

One engine on the embedded default (its decoder weights sit on a Q4_1 grid);
for each batch size, that many requests of random prompts are prefilled, then
decode steps alternate between the two paths (models.packing.Q4_MAX_ROWS
switched in this process, rounds in alternating order) and the medians are
printed. It is how Q4_MAX_ROWS was chosen: the 4-bit path must win where it is used.

    .venv/bin/python benchmarks/bench_q4_rows.py [--batch-sizes 1 4 8 12 16] [--rounds 6]
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
from disagg.workers.engine.models import packing
from disagg.workers.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 320
STEPS_PER_ROUND = 4


def step_ms(engine: LLMEngine, max_rows: int) -> float:
    packing.Q4_MAX_ROWS = max_rows
    start = time.perf_counter()
    for _ in range(STEPS_PER_ROUND):
        engine.step()
    return (time.perf_counter() - start) / STEPS_PER_ROUND * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 12, 16])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    most = max(args.batch_sizes)
    tokens = PROMPT_TOKENS + 2 * args.rounds * STEPS_PER_ROUND + 8
    engine = LLMEngine.from_config(EngineConfig(
        model="builtin:smollm2-135m", device="cpu", dtype="float32", block_size=16,
        num_kv_blocks=most * (tokens // 16 + 2), max_num_seqs=most, max_model_len=tokens + 1,
        enable_prefix_caching=False))
    rng = random.Random(0)
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}\n")
    print("| batch | 4-bit codes (ms/step) | float32 (ms/step) | float32 / 4-bit |\n|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        params = SamplingParams(temperature=0.0, max_tokens=tokens - PROMPT_TOKENS, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)], params)
        while engine.num_waiting or any(r.num_computed_tokens < PROMPT_TOKENS for r in engine.scheduler.running):
            engine.step()
        times: dict[str, list[float]] = {"q4": [], "fp32": []}
        for round_ in range(args.rounds):
            order = ("q4", "fp32") if round_ % 2 == 0 else ("fp32", "q4")
            for path in order:
                times[path].append(step_ms(engine, max_rows=batch if path == "q4" else 0))
        q4_ms, fp32_ms = statistics.median(times["q4"]), statistics.median(times["fp32"])
        print(f"| {batch} | {q4_ms:.1f} | {fp32_ms:.1f} | {fp32_ms / q4_ms:.2f}x |", flush=True)
        for request in list(engine.scheduler.running):
            engine.abort_request(request.request_id)
        engine.step()
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
