"""What a decode step costs alone, and what the same rows cost inside a prompt step (a script, not a test).

A mixed worker runs its decode rows inside the steps that compute new prompts
(chunked prefill), where the weights are read for the prompts anyway; a PD
pair's decode runs them in steps of its own. On cores the two roles share
that difference is paid in CPU, whatever the scheduling, so it bounds what a
co-located pair can reach against a mixed worker (issue 18, item 1).

For each batch size B, median wall milliseconds of:
- a step of `--prompts` new prompts alone (P),
- a decode step of B running requests alone (D),
- a step of as many new prompts with the B decode rows in it (M);
and the rows' marginal cost M - P against D. The three are timed in rounds.

    .venv/bin/python benchmarks/bench_decode_riding.py [--threads 2] [--batch-sizes 8 16 32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from profile_step import build_engine, random_prompt

from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.sampling_params import SamplingParams

DECODE_CONTEXT = 320  # mid-way through the peers benchmark's 256 in + 128 out


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1000


class Load:
    """Requests of random prompts added to one engine under unique ids."""

    def __init__(self, engine: LLMEngine, prompt_tokens: int) -> None:
        self.engine, self.prompt_tokens = engine, prompt_tokens
        self.rng, self.count = random.Random(0), 0

    def add(self, n: int, max_tokens: int) -> list[str]:
        ids = []
        for _ in range(n):
            self.count += 1
            ids.append(f"riding-{self.count}")
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(ids[-1], random_prompt(self.rng, self.prompt_tokens), params)
        return ids


def prompt_step(load: Load, prompts: int) -> float:
    """Wall ms of one step of the load's engine computing `prompts` new prompts, which then end
    (one token each)."""
    load.add(prompts, max_tokens=1)
    wall = timed_step(load.engine)
    load.engine.step()  # their sampled token ends them
    return wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--prompts", type=int, default=2, help="new prompts per prompt step (default: 2, the "
                   "512-token steps a prefill takes while its decode has requests)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=9, help="rounds of the three steps per batch size")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    step_tokens = args.prompts * args.prompt_tokens + max(args.batch_sizes)
    context = DECODE_CONTEXT + 2 * args.rounds + 20

    def new_load() -> Load:
        engine = build_engine(args.model, args.dtype, max(args.batch_sizes) + args.prompts, context, step_tokens)
        return Load(engine, args.prompt_tokens)

    # Two engines, so that P is timed in the same moments as D and M: a step of a second
    # on a shared machine moves by more than the difference sought.
    plain, busy_load = new_load(), new_load()
    busy = busy_load.engine
    print(f"command: {' '.join(sys.orig_argv)}")
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads, prompt steps of {args.prompts} x "
          f"{args.prompt_tokens} tokens, {args.rounds} rounds of (P, M, D); load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| decode rows B | prompt step alone P (ms) | decode step alone D (ms) | prompt step with the rows M (ms) "
          "| M - P, median of rounds (ms) | (M - P) / D |")
    print("|---:|---:|---:|---:|---:|---:|")
    prompt_step(plain, args.prompts)  # warm
    for batch in args.batch_sizes:
        decodes = busy_load.add(batch, max_tokens=context - args.prompt_tokens)
        while busy.num_waiting or any(r.num_computed_tokens < args.prompt_tokens for r in busy.scheduler.running):
            busy.step()  # their prompts
        walls: list[tuple[float, float, float]] = []
        for _ in range(args.rounds):
            alone = prompt_step(plain, args.prompts)
            riding = prompt_step(busy_load, args.prompts)
            walls.append((alone, riding, timed_step(busy)))
        alone, riding, decode = (statistics.median(w[i] for w in walls) for i in range(3))
        marginal = statistics.median(r - a for a, r, _ in walls)
        print(f"| {batch} | {alone:.1f} | {decode:.1f} | {riding:.1f} | {marginal:.1f} | {marginal / decode:.2f} |")
        for request_id in decodes:
            busy.abort_request(request_id)
        while busy.has_unfinished_requests:
            busy.step()
    print(f"\nload average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
