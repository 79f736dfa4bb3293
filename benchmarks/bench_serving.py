"""Serving benchmark with AIPerf (issue 17 item 4): a mixed worker against a PD
pair, on real `disagg serve` processes on loopback (a script, not a test).

AIPerf, NVIDIA's open-source load generator (the successor of genai-perf),
drives our OpenAI chat endpoint, streaming, with synthetic random prompts made
by the model's own tokenizer (read from the local model folder: nothing is
downloaded), at each concurrency in turn; the figures are AIPerf's own, read
from its `profile_export_aiperf.json`, so they mean what they mean in every
other report made with it. The mixed worker gets the usable CPUs, the prefill
and the decode half each (`disagg demo`'s split); the two run one after the other.

AIPerf lives in its own virtual environment (docs/benchmarks.md):

    python3 -m venv /work/venv-bench && /work/venv-bench/bin/pip install aiperf==0.13.0
    .venv/bin/python benchmarks/bench_serving.py [--aiperf-venv /work/venv-bench] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench_pd import SERVED, STARTUP_S
from external import ToolFailed, executable, run

from disagg.workers.config import default_threads
from disagg.workers.demo import running_pair
from disagg.workers.engine.loader import default_cache_dir, resolve_model_dir
from disagg.workers.local import WorkerFailed, WorkerProcess, spawn_worker

AIPERF = "aiperf==0.13.0"  # the version the figures in docs/benchmarks.md were made with


@dataclass(frozen=True)
class Level:
    """AIPerf's summary of one run at one concurrency."""

    setup: str
    concurrency: int
    requests: int
    output_tok_s: float
    request_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float

    @classmethod
    def read(cls, setup: str, concurrency: int, export: Path) -> Level:
        """From AIPerf's `profile_export_aiperf.json`; a run with failed requests is an error."""
        if not export.is_file():
            raise ToolFailed(f"{setup} at concurrency {concurrency}: AIPerf wrote no {export}")
        d = json.loads(export.read_text())
        if d.get("request_error_rate", {}).get("avg", 0.0) or d.get("error_summary"):
            raise ToolFailed(f"{setup} at concurrency {concurrency}: failed requests: {d.get('error_summary')}")
        return cls(setup, concurrency, int(d["completed_request_count"]["avg"]),
                   d["output_token_throughput"]["avg"], d["request_throughput"]["avg"],
                   d["time_to_first_token"]["p50"], d["time_to_first_token"]["p90"],
                   d["inter_token_latency"]["p50"], d["inter_token_latency"]["p90"])


def requests_at(concurrency: int) -> int:
    """Twice the concurrency, at least 4: each user sends two requests, so the batch stays full a while."""
    return max(4, 2 * concurrency)


def aiperf(args: argparse.Namespace, url: str, concurrency: int, out: Path) -> Path:
    """One AIPerf run against `url`; the path of its JSON export."""
    tokenizer = resolve_model_dir(args.model, default_cache_dir())
    run([args.aiperf, "profile", "--model", SERVED, "--url", url,
         "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
         "--isl", args.input_tokens, "--isl-stddev", 0, "--osl", args.output_tokens, "--osl-stddev", 0,
         # every answer runs to --osl, so each run decodes the same number of tokens
         "--extra-inputs", "ignore_eos:true",
         "--concurrency", concurrency, "--request-count", requests_at(concurrency),
         "--warmup-request-count", 1, "--random-seed", args.seed,
         # on 2 cores: few client processes, no scraping beside the clients
         "--workers-max", min(concurrency, 4), "--no-server-metrics", "--no-gpu-telemetry",
         "--ui-type", "none", "--artifact-dir", out],
        out / "aiperf.log", args.run_timeout)
    return out / "profile_export_aiperf.json"


@contextmanager
def running_mixed(model: str, log_dir: Path, extra: list[str]) -> Iterator[WorkerProcess]:
    worker = spawn_worker("mixed", model, log_dir / "mixed.log", extra, threads=default_threads())
    try:
        worker.wait_loaded(STARTUP_S)
        yield worker
    finally:
        worker.stop(15.0)


@contextmanager
def running_prefill(model: str, log_dir: Path, extra: list[str], cpu_turns: bool = True) -> Iterator[WorkerProcess]:
    with running_pair(model, log_dir, extra, STARTUP_S, cpu_turns=cpu_turns) as (prefill, _decode):
        yield prefill


def measure(args: argparse.Namespace, out: Path) -> list[Level]:
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048"]
    levels = []
    for setup, start in (("mixed", running_mixed), ("PD", running_prefill)):
        with start(args.model, out / setup, extra) as worker:
            for c in args.concurrency:
                print(f"{setup}: concurrency {c}, {requests_at(c)} requests...", flush=True)
                export = aiperf(args, worker.base_url, c, out / setup / f"c{c}")
                levels.append(Level.read(setup, c, export))
    return levels


def table(levels: list[Level]) -> str:
    head = ("| setup | concurrency | requests | output tok/s | requests/s | TTFT p50 / p90 (ms) "
            "| ITL p50 / p90 (ms) |\n|---|---:|---:|---:|---:|---:|---:|")
    rows = [f"| {x.setup} | {x.concurrency} | {x.requests} | {x.output_tok_s:.1f} | {x.request_s:.2f} "
            f"| {x.ttft_p50_ms:.0f} / {x.ttft_p90_ms:.0f} | {x.itl_p50_ms:.1f} / {x.itl_p90_ms:.1f} |"
            for x in sorted(levels, key=lambda x: (x.concurrency, x.setup))]
    return "\n".join([head, *rows])


def concurrencies(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers, such as 1,4,16; got {text!r}") from None
    if min(levels) < 1:
        raise argparse.ArgumentTypeError(f"each concurrency must be at least 1; got {text!r}")
    return levels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--aiperf-venv", type=Path, default=Path("/work/venv-bench"),
                   help="the virtual environment AIPerf is installed in (default %(default)s; else the PATH)")
    p.add_argument("--concurrency", type=concurrencies, default=[1, 4, 16], help="comma-separated (default 1,4,16)")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one AIPerf run may take")
    p.add_argument("--out", type=Path, default=None, help="AIPerf's artifacts and the logs (default: a temp folder)")
    args = p.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    load = os.getloadavg()
    began = time.monotonic()
    try:
        args.aiperf = executable("aiperf", args.aiperf_venv, AIPERF)
        levels = measure(args, out)
    except (WorkerFailed, ToolFailed) as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 1
    print(f"\nmodel {args.model}, AIPerf, chat streaming, {args.input_tokens} tokens in, {args.output_tokens} out "
          f"(synthetic, seed {args.seed}); load average at the start {load[0]:.2f}, "
          f"{time.monotonic() - began:.0f} s in all")
    print(table(levels))
    print(f"(AIPerf's artifacts and the logs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
