"""How long a PD hand-off takes when many prompts arrive at once (a script, not a test).

A prefill and a decode (`disagg serve` processes on loopback, PUSH mode) take
N streaming completions of random 256-token prompts at once. Per request the
client's clock gives the first token (the prefill's) and the second (the
decode's first); the gap between them is the hand-off: the last layers' KV
landing on the decode, FirstGeneration, the decode's next step. A hand-off
that waits for the prefill engine (whose next step computes other prompts)
shows here as a gap of a whole prefill step.

    .venv/bin/python benchmarks/bench_handoff.py [--requests 32] [--mode PUSH|PULL]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from bench_pd import SERVED, STARTUP_S

from disagg.workers.demo import running_pair

PROMPT_TOKENS = 256
REQUEST_TIMEOUT_S = 600.0


async def token_times(client: httpx.AsyncClient, url: str, prompt: list[int], t0: float, tokens: int) -> list[float]:
    """Seconds since t0 at which each streamed token arrived."""
    times = []
    body = {"model": SERVED, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.monotonic() - t0)
    return times


async def drive(url: str, requests: int, tokens: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
    async with httpx.AsyncClient() as client:
        t0 = time.monotonic()
        return list(await asyncio.gather(*(token_times(client, url, p, t0, tokens) for p in prompts)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8, help="tokens each request generates")
    p.add_argument("--mode", choices=["PUSH", "PULL"], default="PUSH")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        with running_pair(args.model, Path(logs), ["--served-model-name", SERVED, "--max-model-len", "2048"],
                          STARTUP_S, mode=args.mode) as (prefill, _decode):
            runs = asyncio.run(drive(prefill.base_url, args.requests, args.tokens, args.seed))
    runs.sort(key=lambda times: times[0])
    print(f"{args.requests} requests of {PROMPT_TOKENS} prompt tokens at once, {args.mode}; seconds since the first sent")
    print("| first token (prefill) | second token (decode) | hand-off gap |\n|---:|---:|---:|")
    for times in runs[::max(1, len(runs) // 8)]:
        print(f"| {times[0]:.2f} | {times[1]:.2f} | {times[1] - times[0]:.2f} |")
    gaps = [times[1] - times[0] for times in runs]
    print(f"\nhand-off gap: median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
