"""PD against the mixed worker at concurrency 1, one request each in turn (a script, not a test).

On a machine whose speed moves by half within minutes, two servers measured one
after the other (bench_peers.py) compare badly at concurrency 1, where a round
is a few dozen requests. Here both run at once, idle but for the request in
flight, and take requests alternately (ABBA), so each pair of figures shares
the machine's moment. Each request streams 128 tokens after a random prompt of
256 token ids, greedy with ignore_eos, as bench_peers.py's load; the client
keeps one connection per server.

    .venv/bin/python benchmarks/bench_pd_in_turn.py [--dtype float32] [--requests 12]

Prints, per server, the medians of TTFT, TPOT (first to last token over the
tokens after the first) and the ratio PD / mixed of each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench_pd import SERVED, STARTUP_S
from bench_serving import running_mixed

from disagg.workers.demo import running_pair

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 128


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=12, help="requests per server (default %(default)s)")
    args = p.parse_args()
    rng = random.Random(0)
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048", "--dtype", args.dtype]
    figures: dict[str, list[tuple[float, float]]] = {"mixed": [], "PD": []}
    with tempfile.TemporaryDirectory(prefix="bench-pd-in-turn-") as logs, httpx.Client(timeout=300) as client, \
            running_mixed(args.model, Path(logs) / "mixed", extra) as mixed, \
            running_pair(args.model, Path(logs) / "pd", extra, STARTUP_S) as (prefill, _decode):
        urls = {"mixed": mixed.base_url, "PD": prefill.base_url}
        for url in urls.values():  # a first request each, not counted
            timed_request(client, url, [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)])
        for i in range(args.requests):
            for name in ("mixed", "PD") if i % 2 == 0 else ("PD", "mixed"):
                prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
                figures[name].append(timed_request(client, urls[name], prompt))
                ttft, tpot = figures[name][-1]
                print(f"{name:5} TTFT {ttft * 1000:7.1f} ms  TPOT {tpot * 1000:5.1f} ms", flush=True)
    medians = {name: [statistics.median(column) for column in zip(*rows)] for name, rows in figures.items()}
    print(f"\n{args.dtype}, {args.requests} requests each, medians:")
    for name, (ttft, tpot) in medians.items():
        print(f"  {name:5} TTFT {ttft * 1000:7.1f} ms  TPOT {tpot * 1000:5.1f} ms  ({1 / tpot:.1f} tok/s while streaming)")
    (m_ttft, m_tpot), (pd_ttft, pd_tpot) = medians["mixed"], medians["PD"]
    print(f"  PD / mixed: TTFT {pd_ttft / m_ttft:.2f}x, TPOT {pd_tpot / m_tpot:.2f}x, "
          f"tok/s while streaming {m_tpot / pd_tpot:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
