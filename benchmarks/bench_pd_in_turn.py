"""PD against the mixed worker, in turns on the same machine (a script, not a test).

On a machine whose speed moves by half within minutes, two servers measured one
after the other (bench_peers.py) compare badly: the ratio is mostly the
machine's moment. Here both run at once, idle but for the turn in flight, and
take turns alternately (ABBA), so each pair of figures shares the machine's
moment. A turn is `--requests-per-turn` requests sent by `--concurrency`
clients, each sending its next as soon as its last ends (as `vllm bench serve
--max-concurrency` does); each request streams 128 tokens after a random prompt
of 256 token ids, greedy with ignore_eos, as bench_peers.py's load.

    .venv/bin/python benchmarks/bench_pd_in_turn.py [--dtype float32] [--concurrency 1] [--turns 12] [--pd-args "..."]
        [--per-thread] [--per-request]

Prints, per turn and then as medians over the turns of each server: output
tokens per second, the median TTFT and TPOT (first to last token over the
tokens after the first), and the CPU time each worker process spent per output
token (user + system, from /proc; the PD pair's as decode + prefill); then the
ratios PD / mixed, and the throughput ratio of each pair of neighbouring turns.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench_pd import SERVED, STARTUP_S
from bench_serving import running_mixed

from disagg.testing.processes import cpu_seconds, thread_cpu_seconds
from disagg.workers.demo import running_pair

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 128


@dataclass
class Turn:
    tokens_per_s: float
    ttft_s: float  # median over the turn's requests
    tpot_s: float
    cpu_per_token_s: list[float]  # per worker process
    threads_per_token_s: list[list[float]] = field(default_factory=list)  # per process, busiest first
    requests: list[tuple[float, float, float]] = field(default_factory=list)  # (sent, TTFT, TPOT) s, by sending


def timed_request(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed completion."""
    began = time.monotonic()
    with client.stream("POST", f"{url}/v1/completions", json={
            "model": SERVED, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        response.raise_for_status()
        stamps = [time.monotonic() for line in response.iter_lines() if line.startswith("data: {")]
    if len(stamps) != OUTPUT_TOKENS:
        raise RuntimeError(f"{url} streamed {len(stamps)} chunks, not {OUTPUT_TOKENS}")
    return stamps[0] - began, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def run_turn(client: httpx.Client, url: str, pids: list[int], prompts: list[list[int]], concurrency: int) -> Turn:
    cpu_before = [cpu_seconds(pid) for pid in pids]
    threads_before = [thread_cpu_seconds(pid) for pid in pids]
    began = time.monotonic()

    def sent_and_timed(prompt: list[int]) -> tuple[float, float, float]:
        return (time.monotonic() - began, *timed_request(client, url, prompt))

    with ThreadPoolExecutor(concurrency) as pool:
        requests = sorted(pool.map(sent_and_timed, prompts))
    elapsed = time.monotonic() - began
    tokens = len(prompts) * OUTPUT_TOKENS
    _, ttfts, tpots = zip(*requests)
    threads = [sorted(((seconds - before.get(tid, 0.0)) / tokens for tid, seconds in thread_cpu_seconds(pid).items()),
                      reverse=True) for pid, before in zip(pids, threads_before)]
    return Turn(tokens / elapsed, statistics.median(ttfts), statistics.median(tpots),
                [(cpu_seconds(pid) - before) / tokens for pid, before in zip(pids, cpu_before)],
                threads, requests)


def describe(turn: Turn, per_thread: bool = False) -> str:
    text = (f"{turn.tokens_per_s:6.1f} tok/s  TTFT {turn.ttft_s * 1000:7.1f} ms  TPOT {turn.tpot_s * 1000:5.1f} ms"
            "  CPU per token " + " + ".join(f"{c * 1000:.1f}" for c in turn.cpu_per_token_s) + " ms")
    if per_thread:  # threads of at least 0.05 ms a token, busiest first
        text += "  (threads: " + "; ".join(" / ".join(f"{c * 1000:.2f}" for c in process if c >= 5e-5)
                                           for process in turn.threads_per_token_s) + ")"
    return text


def describe_requests(turn: Turn, concurrency: int) -> str:
    """Each request's sending time, TTFT and TPOT, in the order sent; and the median TTFT of the
    turn's first `concurrency` requests (sent at once) and of the rest (sent as those ended)."""
    lines = [f"    sent {sent:6.1f} s  TTFT {ttft * 1000:7.0f} ms  TPOT {tpot * 1000:5.1f} ms"
             for sent, ttft, tpot in turn.requests]
    ttfts = [ttft for _, ttft, _ in turn.requests]
    medians = [f"{statistics.median(part) * 1000:.0f} ms" for part in (ttfts[:concurrency], ttfts[concurrency:]) if part]
    return "\n".join([*lines, "    median TTFT, first sent at once / the rest: " + " / ".join(medians)])


def median_turn(turns: list[Turn]) -> Turn:
    return Turn(statistics.median(t.tokens_per_s for t in turns), statistics.median(t.ttft_s for t in turns),
                statistics.median(t.tpot_s for t in turns),
                [statistics.median(column) for column in zip(*(t.cpu_per_token_s for t in turns))])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests-per-turn", type=int, default=None,
                   help="default: 1 at concurrency 1, else twice the concurrency")
    p.add_argument("--turns", type=int, default=12, help="turns per server (default %(default)s)")
    p.add_argument("--per-thread", action="store_true",
                   help="also print each turn's CPU per output token of each worker thread (ms, from /proc)")
    p.add_argument("--per-request", action="store_true",
                   help="also print each request's sending time, TTFT and TPOT, turn by turn")
    p.add_argument("--pd-args", default="", help="more flags for the PD pair's two workers, e.g. "
                                                 "\"--pd-policy auto\"")
    args = p.parse_args()
    per_turn = args.requests_per_turn or (1 if args.concurrency == 1 else 2 * args.concurrency)
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]

    extra = ["--served-model-name", SERVED, "--max-model-len", "2048", "--dtype", args.dtype]
    pd_extra = [*extra, *shlex.split(args.pd_args)]
    turns: dict[str, list[Turn]] = {"mixed": [], "PD": []}
    limits = httpx.Limits(max_connections=2 * args.concurrency)
    with tempfile.TemporaryDirectory(prefix="bench-pd-in-turn-") as logs, \
            httpx.Client(timeout=300, limits=limits) as client, \
            running_mixed(args.model, Path(logs) / "mixed", extra) as mixed, \
            running_pair(args.model, Path(logs) / "pd", pd_extra, STARTUP_S) as (prefill, decode):
        urls = {"mixed": mixed.base_url, "PD": prefill.base_url}
        pids = {"mixed": [mixed.process.pid], "PD": [decode.process.pid, prefill.process.pid]}
        for name in urls:  # a first turn each, not counted
            run_turn(client, urls[name], pids[name], prompts(min(per_turn, 2)), args.concurrency)
        for i in range(args.turns):
            for name in ("mixed", "PD") if i % 2 == 0 else ("PD", "mixed"):
                turns[name].append(run_turn(client, urls[name], pids[name], prompts(per_turn), args.concurrency))
                print(f"{name:5} {describe(turns[name][-1], args.per_thread)}", flush=True)
                if args.per_request:
                    print(describe_requests(turns[name][-1], args.concurrency), flush=True)
    print(f"\n{args.dtype}, concurrency {args.concurrency}, {args.turns} turns of {per_turn} requests each, "
          "medians over the turns:")
    mixed_turn, pd_turn = median_turn(turns["mixed"]), median_turn(turns["PD"])
    for name, turn in (("mixed", mixed_turn), ("PD", pd_turn)):
        print(f"  {name:5} {describe(turn)}")
    print(f"  PD / mixed: tok/s {pd_turn.tokens_per_s / mixed_turn.tokens_per_s:.2f}x, "
          f"TTFT {pd_turn.ttft_s / mixed_turn.ttft_s:.2f}x, TPOT {pd_turn.tpot_s / mixed_turn.tpot_s:.2f}x, "
          f"CPU per token {sum(pd_turn.cpu_per_token_s) / sum(mixed_turn.cpu_per_token_s):.2f}x")
    # Turn i of each server ran next to the other's (ABBA): their ratio shares the machine's moment,
    # so the spread of these ratios says how far the median ratio can be trusted.
    ratios = [pd.tokens_per_s / mixed.tokens_per_s for mixed, pd in zip(turns["mixed"], turns["PD"])]
    print("  PD / mixed tok/s, turn by turn: " + " ".join(f"{r:.2f}x" for r in ratios)
          + f" (from {min(ratios):.2f}x to {max(ratios):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
