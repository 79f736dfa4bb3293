"""Engine throughput against Hugging Face transformers `generate` (a script, not a test).

One run, on the same model weights (transformers loads the Hugging Face folder
our loader reads, e.g. the converted GGUF of the embedded default), the same
prompts and the same number of new tokens (greedy; ours with `ignore_eos`,
transformers with `min_new_tokens`), at each batch size:
- output tokens per second of both, and the ratio ours / transformers,
- our time to first token (TTFT) and time per output token (TPOT), per
  request as the engine's outputs arrive, averaged over the batch,
- how many requests produced the same greedy tokens in both (up to our first
  end-of-sequence token, which transformers suppresses): a check that both ran
  the same model.

"Concurrent requests" are N requests added to our engine at once and run to
the end by `LLMEngine.step`; for transformers, the same N prompts in one
left-padded `generate` call. Every batch size is warmed up (untimed) first;
then each round runs ours and transformers back to back, in alternating order.
Rates and times are medians over the rounds, the ratio the median of the
rounds' ratios. The machine's load average is printed before and after: on a
shared machine, rerun when it was high.

    .venv/bin/python benchmarks/bench_engine.py [--batch-sizes 1 8 32] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import default_cache_dir, load_model, resolve_model_dir
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.tokenizer import Tokenizer

# Distinct questions, so prompts differ in content and length (transformers pads them).
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How do plants make food?",
    "Name three primary colors.", "What does a CPU do?", "Explain gravity to a child.",
    "What is the boiling point of water at sea level?", "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?", "What is machine learning?", "Describe a rainbow in one sentence.",
    "What is the largest ocean on Earth?", "Give me a tip for sleeping better.", "What is photosynthesis?",
    "How far is the Moon from the Earth?", "What language is spoken in Brazil?", "Why do cats purr?",
    "What is the square root of sixty-four?", "Suggest a name for a small bakery.", "What causes the seasons?",
    "How does a bicycle stay upright?", "What is an atom made of?", "Write a haiku about autumn leaves.",
    "Which planet is known as the red planet?", "What is the tallest mountain in the world?",
    "How do vaccines work?", "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.", "Why do we have leap years?", "What is a prime number?",
    "How do bees make honey?", "What is the speed of light?",
]


@dataclass(frozen=True)
class Timing:
    """One timed run of a batch of requests."""

    seconds: float
    token_ids: list[list[int]]  # generated ids per request, in prompt order
    ttft_s: list[float]  # per request; empty for transformers
    tpot_s: list[float]  # per request with more than one output token; empty for transformers

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_request_ids = itertools.count()


def time_ours(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int) -> Timing:
    """Adds every prompt at once and steps the engine until all are done."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"bench-{next(_request_ids)}" for _ in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    _sync(engine.model_runner.device)
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests:
        outputs = engine.step()
        # NOTE: step() returns sampled ids as Python ints, so the device work
        # of the step is done by now; no extra synchronisation is needed.
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                tokens[out.request_id].extend(out.new_token_ids)
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    seconds = time.perf_counter() - start
    assert all(len(t) == max_tokens for t in tokens.values()), "ignore_eos runs produce max_tokens each"
    tpot = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in ids if len(tokens[i]) > 1]
    return Timing(seconds, [tokens[i] for i in ids], [first[i] - start for i in ids], tpot)


def time_transformers(model: Any, prompts: Sequence[list[int]], max_tokens: int, pad_id: int) -> Timing:
    """One left-padded greedy `generate` call over all prompts."""
    device = model.device
    width = max(len(p) for p in prompts)
    # [B, width] left-padded ids and their mask: generation continues at the right edge.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None)
    _sync(device)
    seconds = time.perf_counter() - start
    new = out[:, width:].tolist()
    assert all(len(t) == max_tokens for t in new), "min_new_tokens == max_new_tokens fixes the length"
    return Timing(seconds, new, [], [])


def same_greedy(ours: list[int], theirs: list[int], eos_ids: set[int]) -> bool:
    """Equal before our first end-of-sequence token, where transformers, which
    must not stop early, picks another token."""
    end = next((i for i, t in enumerate(ours) if t in eos_ids), len(ours))
    return ours[:end] == theirs[:end]


@dataclass(frozen=True)
class Row:
    batch: int
    ours: list[Timing]  # one per round
    theirs: list[Timing]

    @property
    def ours_tps(self) -> float:
        return statistics.median(t.tokens_per_second for t in self.ours)

    @property
    def theirs_tps(self) -> float:
        return statistics.median(t.tokens_per_second for t in self.theirs)

    @property
    def ratio(self) -> float:
        """Median of the per-round ratios: each round's two runs saw about the same machine load."""
        return statistics.median(a.tokens_per_second / b.tokens_per_second for a, b in zip(self.ours, self.theirs))

    @property
    def ttft_ms(self) -> float:
        return 1e3 * statistics.median(statistics.mean(t.ttft_s) for t in self.ours)

    @property
    def tpot_ms(self) -> float:
        return 1e3 * statistics.median(statistics.mean(t.tpot_s) for t in self.ours if t.tpot_s)

    def num_same(self, eos_ids: set[int]) -> int:
        last_ours, last_theirs = self.ours[-1].token_ids, self.theirs[-1].token_ids
        return sum(same_greedy(a, b, eos_ids) for a, b in zip(last_ours, last_theirs))


def warm_up(engine: LLMEngine, hf_model: Any, prompts: Sequence[list[int]], batch_sizes: Sequence[int],
            tokens: int, pad_id: int) -> None:
    """Untimed runs at every batch size first: the first calls at a new shape pay
    for allocations and kernel selection."""
    for batch in batch_sizes:
        time_ours(engine, prompts[:batch], tokens)
        time_transformers(hf_model, prompts[:batch], tokens, pad_id)


def measure(engine: LLMEngine, hf_model: Any, prompts: Sequence[list[int]], batch: int, max_tokens: int,
            repeats: int, pad_id: int) -> Row:
    """`repeats` rounds of ours and transformers back to back, the order
    alternating from round to round so that a drifting load favours neither."""
    chosen = list(prompts[:batch])
    ours, theirs = [], []
    for round_ in range(repeats):
        if round_ % 2:
            theirs.append(time_transformers(hf_model, chosen, max_tokens, pad_id))
            ours.append(time_ours(engine, chosen, max_tokens))
        else:
            ours.append(time_ours(engine, chosen, max_tokens))
            theirs.append(time_transformers(hf_model, chosen, max_tokens, pad_id))
    assert engine.num_free_blocks == engine.num_total_blocks, "every request freed its blocks"
    assert engine.scheduler.num_preemptions == 0, "a preemption would time recompute: give the KV pool more blocks"
    return Row(batch, ours, theirs)


def markdown_table(rows: Sequence[Row], eos_ids: set[int]) -> str:
    lines = [
        "| concurrent requests | ours (tok/s) | transformers (tok/s) | ours / transformers "
        "| ours TTFT (ms) | ours TPOT (ms) | same greedy tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.batch} | {r.ours_tps:.1f} | {r.theirs_tps:.1f} | {r.ratio:.2f}x "
                     f"| {r.ttft_ms:.0f} | {r.tpot_ms:.1f} | {r.num_same(eos_ids)}/{r.batch} |")
    return "\n".join(lines)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def chat_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts (questions repeat, with a number, past the list's end)."""
    texts = [q if i < len(QUESTIONS) else f"{q} (question {i + 1})"
             for i, q in zip(range(count), itertools.cycle(QUESTIONS))]
    return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m",
                   help="model source for our loader; transformers loads the folder it resolves to")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per batch size (default %(default)s)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of the untimed warm-up runs")
    # NOTE: 1 by default: on a shared machine, two threads that must meet at
    # every op's barrier lose whole time slices to other processes (batch-1
    # runs were 10x slower under load), while one thread degrades gracefully.
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both (default %(default)s; use the core count on an idle machine)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prefix-caching", action="store_true",
                   help="let our engine reuse cached prompt blocks (off by default: transformers has no such cache)")
    p.add_argument("--no-pack-weights", dest="pack_weights", action="store_false",
                   help="run our projections from plain strided weights, not oneDNN-packed ones")
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.max_tokens < 2 or args.repeats < 1 or args.threads < 1:
        p.error("batch sizes and --threads must be positive, --max-tokens at least 2, --repeats at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    from transformers import AutoModelForCausalLM

    print("command:", shlex.join(sys.orig_argv))
    print(f"load average before (1/5/15 min): {load_average()}")
    busy = os.getloadavg()[0]
    if busy > (os.cpu_count() or 1) - args.threads + 0.5:
        print(f"warning: load average {busy:.1f} on {os.cpu_count()} CPUs: other processes compete for the cores "
              f"this run uses; its figures are depressed and noisy")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"torch threads {torch.get_num_threads()} (inter-op {torch.get_num_interop_threads()}); {args.dtype}; "
          f"our weights {'oneDNN-packed' if args.pack_weights else 'strided'}")
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    model_dir = resolve_model_dir(args.model, default_cache_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = chat_prompts(tokenizer, max(args.batch_sizes))
    lengths = [len(p) for p in prompts]
    # A pool that holds the largest batch whole: a preemption would time our
    # scheduler's recompute, not the engine.
    block_size = 16
    blocks_per_request = -(-(max(lengths) + args.max_tokens) // block_size)
    config = EngineConfig(model=args.model, device="cpu", dtype=args.dtype, block_size=block_size,
                          num_kv_blocks=max(args.batch_sizes) * blocks_per_request,
                          max_num_seqs=max(args.batch_sizes), max_model_len=max(lengths) + args.max_tokens + 1,
                          enable_prefix_caching=args.prefix_caching, pack_cpu_weights=args.pack_weights)
    engine = LLMEngine(config, load_model(args.model, dtype, cpu), tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = tokenizer.hf.pad_token_id if tokenizer.hf.pad_token_id is not None else tokenizer.eos_token_ids[0]
    print(f"model {args.model} ({model_dir}); prompts of {min(lengths)}-{max(lengths)} tokens; "
          f"{args.max_tokens} new tokens each, greedy; {args.repeats} rounds, median")

    warm_up(engine, hf_model, prompts, args.batch_sizes, args.warmup_tokens, pad_id)
    rows = []
    for batch in args.batch_sizes:
        row = measure(engine, hf_model, prompts, batch, args.max_tokens, args.repeats, pad_id)
        rows.append(row)
        print(f"  batch {batch:3d}: ours {row.ours_tps:7.1f} tok/s, transformers {row.theirs_tps:7.1f} tok/s, "
              f"{row.ratio:5.2f}x; ours TTFT {row.ttft_ms:6.0f} ms, TPOT {row.tpot_ms:6.1f} ms",
              flush=True)
    eos_ids = set(engine.stop_checker.eos_token_ids)
    print(f"load average after (1/5/15 min): {load_average()}\n")
    print(markdown_table(rows, eos_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
