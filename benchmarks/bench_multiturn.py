"""Multi-turn conversations through a PD pair, decode-side prefix reuse on against off
(a script, not a test): KV bytes moved, blocks skipped, TTFT and throughput.

Each conversation's turn n + 1 is turn n's prompt, its answer and a new user
message, so a decode that keeps what it received can skip all but the new
blocks. Conversations run side by side; the two pairs run one after the other.

    .venv/bin/python benchmarks/bench_multiturn.py [--model builtin:smollm2-135m] [--conversations 4] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_pd import FIRST_ID, SERVED, STARTUP_S, ms

from disagg.workers.config import default_threads
from disagg.workers.local import WorkerFailed, WorkerProcess, link, spawn_worker
from disagg.workers.security.key import ClusterKey


@dataclass
class Turn:
    ttft_s: float
    tokens: list[int]


async def turn(client: httpx.AsyncClient, base_url: str, prompt: list[int] | str, max_tokens: int) -> Turn:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    began = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("token_ids"):
                        first = first or time.perf_counter()
                        tokens += choice["token_ids"]
    assert first is not None, "a turn streams at least one token"
    return Turn(first - began, tokens)


async def conversation(base_url: str, args: argparse.Namespace, seed: int,
                       render: Callable[[list[int]], list[int] | str] = list) -> list[float]:
    """One conversation's turns against `base_url`; the TTFT of each. `render`: how a prompt's ids
    are sent (as ids by default; text for clients that only send text, such as a router)."""
    rng = random.Random(seed)

    def message(n: int) -> list[int]:
        return [FIRST_ID + rng.randrange(args.id_range) for _ in range(n)]

    prompt = message(args.first_tokens)
    ttfts = []
    async with httpx.AsyncClient(timeout=600.0) as client:
        for _ in range(args.turns):
            done = await turn(client, base_url, render(prompt), args.answer_tokens)
            ttfts.append(done.ttft_s)
            prompt = prompt + done.tokens + message(args.message_tokens)
    return ttfts


def measure(args: argparse.Namespace, reuse: bool, log_dir: Path, key_file: Path) -> dict[str, float | str]:
    label = "reuse on" if reuse else "reuse off"
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048", "--kv-prefix-reuse" if reuse
             else "--no-kv-prefix-reuse"]
    threads = default_threads()
    workers = [spawn_worker(role, args.model, log_dir / f"{label.replace(' ', '-')}-{role}.log", extra,
                            key_file=key_file, threads=threads) for role in ("decode", "prefill")]
    try:
        for w in workers:
            w.wait_loaded(STARTUP_S)
        decode, prefill = workers
        if error := link(decode, prefill):
            raise WorkerFailed(f"link: {error}")
        began = time.perf_counter()
        ttfts = asyncio.run(_all(prefill, args))
        seconds = time.perf_counter() - began
        tokens = args.conversations * args.turns * args.answer_tokens
        moved = decode.metric("disagg_kv_transfer_bytes_total", direction="received")
        return {
            "pair": label,
            "KV MB moved": moved / 1e6,
            "KV MB per turn": moved / (args.conversations * args.turns) / 1e6,
            "blocks skipped": decode.metric("disagg_kv_transfer_skipped_blocks_total"),
            "TTFT ms": ms(ttfts), "TTFT median, last turn ms": statistics.median(ttfts[args.turns - 1::args.turns]) * 1e3,
            "output tok/s": tokens / seconds,
        }
    finally:
        for w in workers:
            w.stop(15.0)


async def _all(prefill: WorkerProcess, args: argparse.Namespace) -> list[float]:
    per = await asyncio.gather(*(conversation(prefill.base_url, args, seed) for seed in range(args.conversations)))
    return [t for ttfts in per for t in ttfts]  # conversation by conversation, turn by turn


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The conversations' shape, as `conversation` reads it from the parsed arguments."""
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=256, help="the first turn's prompt (default %(default)s)")
    p.add_argument("--message-tokens", type=int, default=64, help="each later user message (default %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--id-range", type=int, default=20000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    add_workload_arguments(p)
    return p.parse_args(argv)


def run_and_print(args: argparse.Namespace) -> int:
    """Both pairs, reuse off then on, one row each (bench_transfer.py --multiturn calls this too)."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    key_file = log_dir / "cluster.key"
    ClusterKey.generate().write(key_file)
    try:
        rows = [measure(args, reuse, log_dir, key_file) for reuse in (False, True)]
    except WorkerFailed as exc:
        print(f"bench_multiturn: {exc}", file=sys.stderr)
        return 1
    print(f"\nmodel {args.model}, PUSH over tcp; {args.conversations} conversations x {args.turns} turns "
          f"({args.first_tokens} tokens, then +{args.answer_tokens} answer +{args.message_tokens} message per turn)")
    for row in rows:
        print("  ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    print(f"(logs in {log_dir})")
    return 0


def main() -> int:
    args = parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    return run_and_print(args)


if __name__ == "__main__":
    sys.exit(main())
