"""Conditional disaggregation on a mixed workload (a script, not a test): short and long
prompts through a prefill with `--pd-policy always`, one with `auto` (both linked to the
same decode), and a mixed worker; throughput, TTFT and TPOT of each, one target at a time.

    .venv/bin/python benchmarks/bench_policy.py [--model builtin:smollm2-135m] [--requests 48] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_pd import SERVED, STARTUP_S, Prompts, Sample, ms, run_load

from disagg.workers.config import default_threads
from disagg.workers.local import WorkerFailed, WorkerProcess, link, spawn_worker
from disagg.workers.security.key import ClusterKey


def start(args: argparse.Namespace, log_dir: Path) -> dict[str, WorkerProcess]:
    key_file = log_dir / "cluster.key"
    ClusterKey.generate().write(key_file)
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048"]
    threads = default_threads()  # one target and the decode run at a time
    specs = {"decode": ("decode", []), "PD always": ("prefill", ["--pd-policy", "always"]),
             "PD auto": ("prefill", ["--pd-policy", "auto"]), "mixed": ("mixed", [])}
    workers = {name: spawn_worker(role, args.model, log_dir / f"{name.replace(' ', '-')}.log", [*extra, *more],
                                  key_file=key_file, threads=threads) for name, (role, more) in specs.items()}
    for w in workers.values():
        w.wait_loaded(STARTUP_S)
    for name in ("PD always", "PD auto"):
        if error := link(workers["decode"], workers[name]):
            raise WorkerFailed(f"link: {error}")
    return workers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--short", type=int, default=16, help="a short prompt's tokens (default %(default)s)")
    p.add_argument("--long", type=int, default=512, help="a long prompt's tokens (default %(default)s)")
    p.add_argument("--short-share", type=float, default=0.75, help="share of short prompts (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-policy-"))
    workers: dict[str, WorkerProcess] = {}
    try:
        workers = start(args, log_dir)
        rng = random.Random(0)
        lengths = [args.short if rng.random() < args.short_share else args.long for _ in range(args.requests)]
        prompts = Prompts(20000)
        print(f"\n{args.requests} requests, {sum(n == args.short for n in lengths)} of {args.short} tokens and the "
              f"rest of {args.long}, {args.max_tokens} out, concurrency {args.concurrency}; mean / p90 ms")
        for name in ("mixed", "PD always", "PD auto"):
            began = time.perf_counter()
            samples: list[Sample] = asyncio.run(run_load(workers[name], [prompts.next(n) for n in lengths],
                                                         args.concurrency, args.max_tokens))
            seconds = time.perf_counter() - began
            tokens = sum(s.tokens for s in samples)
            local = workers[name].metric("disagg_pd_decision_total", decision="local")
            print(f"{name:10s} {tokens / seconds:6.1f} tok/s  TTFT {ms([s.ttft_s for s in samples])}  "
                  f"TPOT {ms([s.tpot_s for s in samples])}  median TTFT "
                  f"{statistics.median(s.ttft_s for s in samples) * 1e3:6.1f}  served locally: {local:.0f}")
    except WorkerFailed as exc:
        print(f"bench_policy: {exc}", file=sys.stderr)
        return 1
    finally:
        for w in workers.values():
            w.stop(15.0)
    print(f"(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
