"""Per-pod capacity curves of the two roles, measured on the real engine (a script, not a test).

Writes the JSON profile `benchmarks/sim_planner.py` reads, the way Dynamo's
planner profiles TTFT and ITL before it plans:
- prefill: for each prompt length and number of prompts arriving together,
  time to first token (each request's own, mean and p90) and prompt tokens per
  second (the batch's prompt tokens over the time the last first token came);
- decode: for each number of running sequences, time per output token (each
  step's time, mean and p90) and generated tokens per second.
The engine runs in this process with `LLMEngine.step`, exactly as a worker
does, with prefix caching off (random prompts, so no hit anyway) and greedy
sampling. The load average before and after is recorded: on a shared machine
the figures are pessimistic.

    .venv/bin/python benchmarks/profile_roles.py [--model PATH|builtin:smollm2-135m] [--out benchmarks/profiles/tiny-llama-cpu.json]

Without `--model` it builds the tiny random Llama of the tests (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import load_model
from disagg.workers.engine.sampling_params import SamplingParams

DEFAULT_OUT = Path(__file__).parent / "profiles" / "tiny-llama-cpu.json"


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run with the median `key`: one whole run, so its figures stay consistent with each other."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


class Profiler:
    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.count = 0

    def _add(self, prompt_len: int, max_tokens: int) -> str:
        self.count += 1
        request_id = f"profile-{self.count}"
        prompt = [self.rng.randrange(self.vocab) for _ in range(prompt_len)]
        self.engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True))
        return request_id

    def prefill(self, prompt_len: int, batch: int) -> dict[str, Any]:
        """`batch` prompts arrive together; each gets one token (a prefill pod's whole job)."""
        start = time.perf_counter()
        ids = {self._add(prompt_len, 1) for _ in range(batch)}
        ttft: list[float] = []
        while self.engine.has_unfinished_requests:
            outputs = self.engine.step()
            now = time.perf_counter()
            ttft += [now - start for o in outputs if o.request_id in ids and o.new_token_ids]
        elapsed = max(ttft)
        return {"prompt_len": prompt_len, "batch": batch, "ttft_mean_s": statistics.fmean(ttft),
                "ttft_p90_s": p90(ttft), "prompt_tokens_per_s": batch * prompt_len / elapsed}

    def decode(self, batch: int, context_len: int, steps: int) -> dict[str, Any]:
        """`batch` sequences of `context_len` tokens decode together; only steps with all of them running count."""
        for _ in range(batch):
            self._add(context_len, steps + 2)
        step_times: list[float] = []
        while self.engine.has_unfinished_requests:
            running_before = len(self.engine.scheduler.running)
            start = time.perf_counter()
            outputs = self.engine.step()
            decoding = [o for o in outputs if o.num_output_tokens > 1]
            if running_before == batch and len(decoding) == batch:
                step_times.append(time.perf_counter() - start)
        assert step_times, f"no step decoded all {batch} sequences"
        return {"batch": batch, "context_len": context_len, "tpot_mean_s": statistics.fmean(step_times),
                "tpot_p90_s": p90(step_times), "generation_tokens_per_s": batch / statistics.fmean(step_times)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model source; default: the tests' tiny random Llama")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128, 384])
    parser.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; the median run is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a one-CPU pod, and no "
                                                                  "oversubscription on a shared machine)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from disagg.testing.tiny_model import build_tiny_model
            model = str(build_tiny_model("llama", Path(tmp) / "tiny-llama"))
        config = EngineConfig(model=model, device="cpu", dtype="float32", max_num_seqs=args.max_num_seqs,
                              num_kv_blocks=4096, enable_prefix_caching=False, max_num_batched_tokens=4096)
        engine = LLMEngine(config, load_model(model, torch.float32, torch.device("cpu")))
        profiler = Profiler(engine)
        load_before = os.getloadavg()
        profiler.prefill(args.prompt_lens[0], 1)  # warm-up, untimed
        prefill = [median_run([profiler.prefill(n, b) for _ in range(args.repeats)], "ttft_mean_s")
                   for n in args.prompt_lens for b in args.prefill_batches]
        decode = [median_run([profiler.decode(b, args.context_len, args.steps) for _ in range(args.repeats)],
                             "tpot_mean_s") for b in args.decode_batches]
        load_after = os.getloadavg()

    profile = {
        "model": args.model or "tiny random llama (disagg.testing.tiny_model)",
        "device": "cpu", "dtype": "float32", "cpus": os.cpu_count(), "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(), "max_num_seqs": args.max_num_seqs,
        "load_average_before": load_before, "load_average_after": load_after,
        "note": "measured on a shared 2-core machine with other work running: absolute figures are pessimistic",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "prefill": prefill, "decode": decode,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    for row in prefill:
        print(f"prefill len {row['prompt_len']:4d} x{row['batch']:<3d} TTFT mean {row['ttft_mean_s'] * 1000:7.1f} ms "
              f"p90 {row['ttft_p90_s'] * 1000:7.1f} ms  {row['prompt_tokens_per_s']:8.0f} prompt tok/s")
    for row in decode:
        print(f"decode x{row['batch']:<3d} TPOT mean {row['tpot_mean_s'] * 1000:6.1f} ms "
              f"p90 {row['tpot_p90_s'] * 1000:6.1f} ms  {row['generation_tokens_per_s']:7.0f} tok/s")
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
