"""Behind a real router (issue 17 item 3): sglang-router in regular mode in front
of two prefills that share one decode, cache-aware routing against round-robin
(a script, not a test).

The workload is bench_multiturn's: conversations side by side, each turn
re-sending the whole history plus a new message, so a prefill that saw the
conversation's last turn holds all but its newest blocks. The router routes
on text (it does not take token-id prompts), so each prompt is sent as its
ids' text. Each policy gets fresh workers; measured are TTFT as the client
sees it and the prefix-cache hit rate of each role, from our workers'
`disagg_prefix_cache_hits` / `disagg_prefix_cache_queries` (prompt tokens).

sglang-router lives in its own virtual environment (docs/benchmarks.md):

    python3 -m venv /work/venv-router && /work/venv-router/bin/pip install sglang-router==0.3.2
    .venv/bin/python benchmarks/bench_router.py [--router-venv /work/venv-router] [--conversations 4] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench_multiturn import add_workload_arguments, conversation
from bench_pd import SERVED, STARTUP_S, ms
from external import ToolFailed, executable, serving

from disagg.workers.config import default_threads
from disagg.workers.engine.loader import default_cache_dir, resolve_model_dir
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.local import LOOPBACK, WorkerFailed, WorkerProcess, free_port, link, spawn_worker
from disagg.workers.security.key import ClusterKey

ROUTER = "sglang-router==0.3.2"  # the version the figures in docs/benchmarks.md were made with
POLICIES = ("round_robin", "cache_aware")
ROUTER_READY_S = 60.0


@contextmanager
def two_prefills_one_decode(model: str, log_dir: Path) -> Iterator[tuple[WorkerProcess, list[WorkerProcess]]]:
    """A decode linked to two prefills, loaded; all three stopped on the way out."""
    key_file = log_dir / "cluster.key"
    log_dir.mkdir(parents=True, exist_ok=True)
    ClusterKey.generate().write(key_file)
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048"]
    threads = default_threads()
    workers: list[WorkerProcess] = []
    try:
        for role, name in (("decode", "decode"), ("prefill", "prefill-a"), ("prefill", "prefill-b")):
            workers.append(spawn_worker(role, model, log_dir / f"{name}.log", extra, key_file=key_file,
                                        threads=threads))
        for w in workers:
            w.wait_loaded(STARTUP_S)
        decode, *prefills = workers
        for prefill in prefills:
            if error := link(decode, prefill):
                raise WorkerFailed(f"link to {prefill.instance_name}: {error}")
        yield decode, prefills
    finally:
        for w in reversed(workers):
            w.stop(15.0)


def router_command(args: argparse.Namespace, policy: str, port: int, prefills: list[WorkerProcess]) -> list[str | Path]:
    """sglang-router, regular mode: each prefill's OpenAI API is one worker URL."""
    return [args.router, "launch", "--host", LOOPBACK, "--port", str(port),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port()),
            "--worker-urls", *(p.base_url for p in prefills), "--policy", policy,
            "--request-timeout-secs", "600", "--log-level", "warn"]


@dataclass(frozen=True)
class Outcome:
    policy: str
    ttfts: list[float]  # conversation by conversation, turn by turn
    seconds: float
    hit_rate: dict[str, float]  # by role, or by prefill
    prompt_tokens_per_prefill: list[float]


def hit_rate(workers: list[WorkerProcess], role: str) -> float:
    queries = sum(w.metric("disagg_prefix_cache_queries_total", role=role) for w in workers)
    hits = sum(w.metric("disagg_prefix_cache_hits_total", role=role) for w in workers)
    return hits / queries if queries else 0.0


async def _conversations(url: str, args: argparse.Namespace, tokenizer: Tokenizer) -> list[float]:
    per = await asyncio.gather(*(conversation(url, args, seed, tokenizer.decode)
                                 for seed in range(args.conversations)))
    return [t for ttfts in per for t in ttfts]


def measure(args: argparse.Namespace, policy: str, log_dir: Path, tokenizer: Tokenizer) -> Outcome:
    with two_prefills_one_decode(args.model, log_dir / policy) as (decode, prefills):
        port = free_port()
        with serving(router_command(args, policy, port, prefills), log_dir / policy / "router.log",
                     f"http://{LOOPBACK}:{port}/readiness", ROUTER_READY_S):
            began = time.perf_counter()
            ttfts = asyncio.run(_conversations(f"http://{LOOPBACK}:{port}", args, tokenizer))
            seconds = time.perf_counter() - began
        return Outcome(
            policy, ttfts, seconds,
            {"prefills": hit_rate(prefills, "prefill"), "prefill a": hit_rate(prefills[:1], "prefill"),
             "prefill b": hit_rate(prefills[1:], "prefill"), "decode": hit_rate([decode], "decode")},
            [p.metric("disagg_prefix_cache_queries_total", role="prefill") for p in prefills])


def report(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    head = ("| policy | TTFT mean / p90 (ms) | TTFT median, turns 2+ (ms) | prefix hits, prefills "
            "| per prefill (a / b) | prompt tokens a / b | prefix hits, decode | wall (s) |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for o in outcomes:
        later = [t for i, t in enumerate(o.ttfts) if i % args.turns]
        rows.append(f"| {o.policy} | {' '.join(ms(o.ttfts).split())} | {statistics.median(later) * 1e3:.0f} "
                    f"| {o.hit_rate['prefills']:.1%} | {o.hit_rate['prefill a']:.1%} / {o.hit_rate['prefill b']:.1%} "
                    f"| {o.prompt_tokens_per_prefill[0]:.0f} / {o.prompt_tokens_per_prefill[1]:.0f} "
                    f"| {o.hit_rate['decode']:.1%} | {o.seconds:.1f} |")
    return "\n".join([head, *rows])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--router-venv", type=Path, default=Path("/work/venv-router"),
                   help="the virtual environment sglang-router is installed in (default %(default)s; else the PATH)")
    add_workload_arguments(p)
    args = p.parse_args()
    if args.turns < 2:
        p.error("--turns must be at least 2: the first turn of a conversation has nothing to reuse")
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    tokenizer = Tokenizer.from_dir(resolve_model_dir(args.model, default_cache_dir()))
    load = os.getloadavg()
    try:
        args.router = executable("sglang-router", args.router_venv, ROUTER)
        outcomes = [measure(args, policy, log_dir, tokenizer) for policy in POLICIES]
    except (WorkerFailed, ToolFailed) as exc:
        print(f"bench_router: {exc}", file=sys.stderr)
        return 1
    print(f"\nmodel {args.model}, sglang-router (regular mode) over 2 prefills sharing 1 decode, PUSH over tcp; "
          f"{args.conversations} conversations x {args.turns} turns ({args.first_tokens} tokens, then "
          f"+{args.answer_tokens} answer +{args.message_tokens} message per turn); load average at the start "
          f"{load[0]:.2f}")
    print(report(args, outcomes))
    print(f"(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
