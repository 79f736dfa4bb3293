"""Where one step of the engine goes, by kind of work (a script, not a test).

For each batch size: that many requests of random prompts are prefilled, a few
decode steps warm up, then the torch profiler records `--steps` decode steps of
`LLMEngine.step` (what a worker runs); then the same for steps that prefill
`--prefill-prompts` new prompts at once. The script prints the milliseconds
per step spent in each kind of op, with the median wall time of unprofiled
steps beside them. "Python and framework" is the wall time the ops do not
cover: the model's Python, dispatch, scheduling and sampling bookkeeping.

Run it with and without the C kernels to compare them on the same machine:

    .venv/bin/python benchmarks/profile_step.py                           # the C kernels where they build
    DISAGG_CPU_KERNELS=off .venv/bin/python benchmarks/profile_step.py    # PyTorch ops only (before)
    DISAGG_CPU_ATTENTION=gather .venv/bin/python benchmarks/profile_step.py   # attention by PyTorch (gather, SDPA)
    DISAGG_CPU_LINEAR=onednn .venv/bin/python benchmarks/profile_step.py   # float32 projections by oneDNN

"Python and framework" is a difference of two timings, noisy where a row has
few steps; `--python-top N` also runs each row's steps under cProfile and
prints the N functions with the most time of their own, ops included.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from disagg.workers.engine import cpu_attention
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.models import cpu_fused, cpu_norm, grids, packing, panels
from disagg.workers.engine.sampling_params import SamplingParams

# Ops by kind, by the names the profiler gives them; anything else is "elementwise and glue".
KINDS = {
    "projections: oneDNN (and BLAS)": {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm"},
    "projections: panels (C kernels)": {panels.PROFILE_LABEL},
    "projections: grid codes (C kernel)": {grids.PROFILE_LABEL},
    "attention: paged C kernel": {cpu_attention.PROFILE_LABEL},
    "attention: prompts' C kernel": {cpu_attention.PREFILL_PROFILE_LABEL},
    "RMSNorm (C kernel)": {cpu_norm.PROFILE_LABEL},
    "SiLU x up, RoPE (C kernels)": {cpu_fused.PROFILE_LABEL},
    "attention: gather + SDPA (prefills; decodes without the kernel)": {
        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select",
        "aten::_scaled_dot_product_attention_math"},
    "KV writes": {"aten::index_copy_"},
}
OTHER = "elementwise and glue (residual adds, copies; PyTorch's norms, RoPE, SiLU without the kernels)"
PYTHON = "Python and framework (not in an op)"


def kind_of(op_name: str) -> str:
    return next((kind for kind, names in KINDS.items() if op_name in names), OTHER)


def build_engine(model: str, dtype: str, batch: int, context: int, step_tokens: int) -> LLMEngine:
    block_size = 16
    blocks = batch * (-(-context // block_size) + 1)
    config = EngineConfig(model=model, device="cpu", dtype=dtype, block_size=block_size, num_kv_blocks=blocks,
                          max_num_seqs=batch, max_model_len=context + 1, max_num_batched_tokens=step_tokens,
                          enable_prefix_caching=False)
    return LLMEngine.from_config(config)


def measure(engine: LLMEngine, steps: int, prepare: Callable[[], None],
            python: cProfile.Profile | None = None) -> tuple[float, dict[str, float]]:
    """(median wall ms of a step, ms per step by kind): `steps` steps timed, then
    `steps` profiled, then `steps` under `python` if given; `prepare` runs before
    each, untimed."""
    walls = []
    for _ in range(steps):
        prepare()
        start = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - start) * 1000)
    by_kind: dict[str, float] = defaultdict(float)
    for _ in range(steps):
        prepare()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        for event in prof.key_averages():
            by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1000 / steps
    if python is not None:
        for _ in range(steps):
            prepare()
            python.enable()
            engine.step()
            python.disable()
    wall = statistics.median(walls)
    by_kind[PYTHON] = max(0.0, wall - sum(by_kind.values()))
    return wall, dict(by_kind)


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


def profile_batch(engine: LLMEngine, batch: int, prompt_tokens: int, steps: int,
                  python: cProfile.Profile | None = None) -> tuple[float, dict[str, float]]:
    """(median wall ms of a decode step, ms per step by kind) for `batch` running requests."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 10, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", random_prompt(rng, prompt_tokens), params)
    while engine.num_waiting or any(r.num_computed_tokens < prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()
    result = measure(engine, steps, lambda: None, python)
    while engine.has_unfinished_requests:
        engine.step()
    return result


def profile_prefill(engine: LLMEngine, prompts: int, prompt_tokens: int, steps: int,
                    python: cProfile.Profile | None = None) -> tuple[float, dict[str, float]]:
    """(median wall ms, ms by kind) of a step that prefills `prompts` new prompts at once."""
    rng = random.Random(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    added = iter(range(10**9))

    def add_prompts() -> None:
        while engine.has_unfinished_requests:
            engine.step()  # the previous step's requests finish
        for _ in range(prompts):
            engine.add_request(f"prefill-{next(added)}", random_prompt(rng, prompt_tokens), params)

    add_prompts()
    engine.step()  # warm
    return measure(engine, steps, add_prompts, python)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-tokens", type=int, default=320, help="context of each request (default: 320, "
                   "mid-way through the peers benchmark's 256 in + 128 out)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill-prompts", type=int, default=8, help="new prompts of --prefill-tokens each prefilled "
                   "in one profiled step (default: 8, a step of the peers benchmark's first wave at c=32; 0: none)")
    p.add_argument("--prefill-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--python-top", type=int, default=0, metavar="N",
                   help="also print each row's N functions with the most own time under cProfile")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = "the paged C kernel" if cpu_attention.is_available() else "the gather path"
    dtype = getattr(torch, args.dtype)
    path += f"; {args.dtype} projections: " + ("panel kernel" if panels.preferred(dtype) else "oneDNN")
    path += ", from grid codes where weights sit on one" if packing.codes_may_serve(dtype) else ""
    print(f"command: {' '.join(sys.orig_argv)}")
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads, decode attention: {path}; "
          f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    context = max(args.prompt_tokens + 3 * args.steps + 20, args.prefill_tokens + 1)
    prefill_tokens = args.prefill_prompts * args.prefill_tokens
    # A budget for each batch's prompts in one step: prefilled a few tokens a step, a batch's first
    # requests would finish decoding before its last ones start.
    step_tokens = max(prefill_tokens, max(args.batch_sizes) * args.prompt_tokens)
    engine = build_engine(args.model, args.dtype, max(*args.batch_sizes, args.prefill_prompts), context, step_tokens)
    pythons: dict[str, tuple[cProfile.Profile, int]] = {}

    def python_profile(row: str, steps: int) -> cProfile.Profile | None:
        if not args.python_top:
            return None
        pythons[row] = (cProfile.Profile(), steps)
        return pythons[row][0]

    rows = []
    for batch in args.batch_sizes:
        row = f"decode, batch {batch}"
        rows.append((row, *profile_batch(engine, batch, args.prompt_tokens, args.steps,
                                         python_profile(row, args.steps))))
    if args.prefill_prompts:
        row, steps = f"prefill, {args.prefill_prompts} x {args.prefill_tokens} tokens", max(1, args.steps // 5)
        rows.append((row, *profile_prefill(engine, args.prefill_prompts, args.prefill_tokens, steps,
                                           python_profile(row, steps))))
    kinds = [*KINDS, OTHER, PYTHON]
    print("\n| ms per step | " + " | ".join(name for name, _, _ in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    print("| **wall (median)** | " + " | ".join(f"**{wall:.1f}**" for _, wall, _ in rows) + " |")
    for kind in kinds:
        if any(split.get(kind, 0.0) >= 0.05 for _, _, split in rows):
            print(f"| {kind} | " + " | ".join(f"{split.get(kind, 0.0):.1f}" for _, _, split in rows) + " |")
    for row, (python, steps) in pythons.items():
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(args.python_top)
        print(f"\n{row}: cProfile over {steps} steps, by own time\n{text.getvalue().strip()}")
    print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
