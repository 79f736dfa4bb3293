"""End to end: prefill + decode (PD) against the mixed role, on real `disagg serve`
processes on loopback (a script, not a test).

1. Time to first token (TTFT) and time per output token (TPOT) as a streaming
   client sees them, at a few prompt lengths and concurrencies.
2. Interference, the case PD exists for: the TPOT of requests that are
   decoding while long prompts keep arriving, against the same requests with
   no arrivals.

3. With --load: throughput under load, mixed against PD on the same prompts
   at concurrency 1, 8 and 32, rounds alternating which goes first, with the
   PD/mixed ratios.

The mixed worker, the prefill and the decode each get the machine's usable
CPUs as compute threads, as `disagg demo` gives them, and the prefill and the
decode take turns on them (`--cpu-turn-dir`; `--no-cpu-turns` runs them
without): the roles are driven one at a time, so the mixed worker idles while
the pair serves.

    .venv/bin/python benchmarks/bench_pd.py [--model builtin:smollm2-135m] [--quick] [--load]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from disagg.workers.config import default_threads
from disagg.workers.local import WorkerFailed, WorkerProcess, link, spawn_worker
from disagg.workers.pd.cpu_turns import DEFAULT_DECODE_WAIT_S

STARTUP_S = 900.0
SERVED = "bench"


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    tpot_s: float | None  # None for a single output token
    tokens: int


FIRST_ID = 100  # prompt token ids start past the special tokens


class Prompts:
    """Fresh prompts of ordinary token ids: no two share a first token, so no prefix-cache hits."""

    def __init__(self, id_range: int) -> None:
        self._range = id_range
        self._count = 0

    def next(self, n: int) -> list[int]:
        self._count += 1
        first = FIRST_ID + self._count % self._range
        return [first] + [FIRST_ID + (7919 * i + 31 * self._count) % self._range for i in range(1, n)]


async def stream_one(client: httpx.AsyncClient, worker: WorkerProcess, prompt: list[int], max_tokens: int,
                     fields: dict[str, Any] | None = None) -> Sample:
    """One streamed completion (greedy, to max_tokens unless `fields` say otherwise); times as the client sees them."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, **(fields or {})}
    began = time.perf_counter()
    first = last = None
    n = 0
    async with client.stream("POST", f"{worker.base_url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{worker.role}: {chunk['error']['message']}")
            got = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
            if got:
                now = time.perf_counter()
                first = first or now
                last = now
                n += got
    assert first is not None and last is not None, "a completion streams at least one token"
    return Sample(first - began, (last - first) / (n - 1) if n > 1 else None, n)


async def run_load(worker: WorkerProcess, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Sample]:
    """One request per prompt, `concurrency` at a time."""
    todo = list(prompts)
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=600.0) as client:

        async def user() -> None:
            while todo:
                samples.append(await stream_one(client, worker, todo.pop(), max_tokens))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return samples


async def run_interference(worker: WorkerProcess, prompts: Prompts, decoders: int, decode_tokens: int,
                           long_prompt: int, arrivals: bool) -> list[Sample]:
    """TPOT of `decoders` running requests; with `arrivals`, long prompts (1 output token) arrive
    back to back until they finish."""
    async with httpx.AsyncClient(timeout=600.0) as client:
        running = [asyncio.create_task(stream_one(client, worker, prompts.next(32), decode_tokens))
                   for _ in range(decoders)]
        while arrivals and not all(t.done() for t in running):
            await stream_one(client, worker, prompts.next(long_prompt), 1)
        return list(await asyncio.gather(*running))


def ms(values: Sequence[float | None]) -> str:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return "       n/a"
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{statistics.mean(xs) * 1e3:7.1f} / {p90 * 1e3:7.1f}"


def start_workers(model: str, log_dir: Path, args: argparse.Namespace,
                  started: list[WorkerProcess]) -> tuple[WorkerProcess, WorkerProcess, WorkerProcess]:
    """A linked prefill and decode, and a mixed worker; each appended to `started` as it starts."""
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048"]
    env = dict(kv.split("=", 1) for kv in args.worker_env)
    turns = ["--cpu-turn-dir", str(log_dir / "cpu-turns")] if args.cpu_turns else []
    decode_turns = [*turns, "--cpu-turn-wait-ms", str(args.cpu_turn_wait_ms)] if args.cpu_turns else []
    for role, threads, more in (("decode", args.pd_threads, decode_turns),
                                ("prefill", args.pd_threads, [*turns, "--kv-transfer-mode", args.kv_transfer_mode]),
                                ("mixed", args.threads, [])):
        started.append(spawn_worker(role, model, log_dir / f"{role}.log", [*extra, *more], env=env, threads=threads))
    decode, prefill, mixed = started
    for w in started:
        w.wait_loaded(STARTUP_S)
    error = link(decode, prefill)
    if error:
        raise WorkerFailed(f"link: {error}")
    return prefill, decode, mixed


@dataclass(frozen=True)
class Load:
    """One load case on one worker: output tokens per second over the wall time, and medians."""

    tok_s: float
    ttft_s: float
    tpot_s: float

    @classmethod
    async def measure(cls, worker: WorkerProcess, prompts: list[list[int]], conc: int, max_tokens: int) -> Load:
        began = time.perf_counter()
        samples = await run_load(worker, prompts, conc, max_tokens)
        wall = time.perf_counter() - began
        return cls(sum(s.tokens for s in samples) / wall, statistics.median(s.ttft_s for s in samples),
                   statistics.median(s.tpot_s for s in samples if s.tpot_s is not None))


async def bench_load(targets: dict[str, WorkerProcess], args: argparse.Namespace) -> None:
    """Mixed and PD on the same prompts at each concurrency; rounds alternate which goes first."""
    prompts = Prompts(args.id_range)
    for w in targets.values():  # warm up (first-call allocations)
        await run_load(w, [prompts.next(16)], 1, 4)
    print(f"\nload: {args.load_prompt} prompt tokens, {args.load_tokens} output tokens (ignore_eos, greedy), "
          f"max({args.requests}, concurrency) requests per case; tok/s, median TTFT and TPOT in ms")
    print(f"{'round':>5s} {'conc':>4s} | {'mixed tok/s':>11s} {'TTFT':>7s} {'TPOT':>6s} | "
          f"{'PD tok/s':>8s} {'TTFT':>7s} {'TPOT':>6s} | PD/mixed: tok/s  TTFT  TPOT")
    for r in range(args.rounds):
        for conc in args.concurrency:
            batch = [prompts.next(args.load_prompt) for _ in range(max(args.requests, conc))]
            order = list(targets.items()) if r % 2 == 0 else list(reversed(targets.items()))
            got = {name: await Load.measure(w, batch, conc, args.load_tokens) for name, w in order}
            m, pd = got["mixed"], got["PD"]
            print(f"{r + 1:5d} {conc:4d} | {m.tok_s:11.1f} {m.ttft_s * 1e3:7.0f} {m.tpot_s * 1e3:6.1f} | "
                  f"{pd.tok_s:8.1f} {pd.ttft_s * 1e3:7.0f} {pd.tpot_s * 1e3:6.1f} | "
                  f"{pd.tok_s / m.tok_s:14.2f}x {pd.ttft_s / m.ttft_s:4.2f}x {pd.tpot_s / m.tpot_s:4.2f}x",
                  flush=True)


async def bench(prefill: WorkerProcess, mixed: WorkerProcess, args: argparse.Namespace) -> None:
    targets = {"PD": prefill, "mixed": mixed}
    prompts = Prompts(args.id_range)
    for w in targets.values():  # warm up (first-call allocations)
        await run_load(w, [prompts.next(16)], 1, 4)
    print(f"\n1. streaming client, {args.max_tokens} output tokens, greedy; mean / p90 in ms")
    print(f"{'role':6s} {'prompt':>6s} {'conc':>4s} {'reqs':>4s}   {'TTFT mean / p90':>17s}   {'TPOT mean / p90':>17s}")
    for prompt_len in args.prompt_lens:
        for conc in args.concurrency:
            for name, w in targets.items():
                n = max(args.requests, conc * 2)
                samples = await run_load(w, [prompts.next(prompt_len) for _ in range(n)], conc, args.max_tokens)
                print(f"{name:6s} {prompt_len:6d} {conc:4d} {n:4d}   {ms([s.ttft_s for s in samples])}   "
                      f"{ms([s.tpot_s for s in samples])}", flush=True)
    print(f"\n2. interference: TPOT (ms, mean / p90) of {args.decoders} decoding requests of {args.decode_tokens} "
          f"tokens, alone and while prompts of {args.long_prompt} tokens keep arriving")
    print(f"{'role':6s}   {'alone':>17s}   {'with arrivals':>17s}   slowdown")
    for name, w in targets.items():
        alone = await run_interference(w, prompts, args.decoders, args.decode_tokens, args.long_prompt, False)
        busy = await run_interference(w, prompts, args.decoders, args.decode_tokens, args.long_prompt, True)
        a = statistics.mean(s.tpot_s for s in alone if s.tpot_s is not None)
        b = statistics.mean(s.tpot_s for s in busy if s.tpot_s is not None)
        print(f"{name:6s}   {ms([s.tpot_s for s in alone])}   {ms([s.tpot_s for s in busy])}   {b / a:6.2f}x",
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--kv-transfer-mode", choices=("PUSH", "PULL"), default="PUSH")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="compute threads of the mixed worker (default: the usable CPUs, %(default)s)")
    p.add_argument("--pd-threads", type=int, default=default_threads(),
                   help="compute threads of the prefill and of the decode (default: the usable CPUs, %(default)s)")
    p.add_argument("--cpu-turns", action=argparse.BooleanOptionalAction, default=True,
                   help="the prefill and the decode take turns on the cores they share (default: on)")
    p.add_argument("--cpu-turn-wait-ms", type=float, default=DEFAULT_DECODE_WAIT_S * 1000,
                   help="the decode's --cpu-turn-wait-ms (default %(default)g)")
    p.add_argument("--worker-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="environment of every worker, e.g. GOMP_SPINCOUNT=300000 (libgomp's spinning default)")
    p.add_argument("--load", action="store_true",
                   help="only the load comparison: mixed against PD at each --concurrency, --rounds times")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--load-prompt", type=int, default=256)
    p.add_argument("--load-tokens", type=int, default=128)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 512])
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 4 (with --load: 1 8 32)")
    p.add_argument("--requests", type=int, default=4, help="requests per case (at least 2x the concurrency)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompt", type=int, default=768)
    p.add_argument("--id-range", type=int, default=20000,
                   help="prompt token ids are 100 + [0, this): keep it under the vocabulary (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="one small case of each kind (a smoke run)")
    args = p.parse_args()
    # A SIGTERM (`timeout`) unwinds like Ctrl-C, so the workers below are stopped, not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.concurrency = args.concurrency or ([1, 8, 32] if args.load else [1, 4])
    if args.quick:
        args.prompt_lens, args.concurrency, args.requests, args.max_tokens = [32], [2], 2, 8
        args.decoders, args.decode_tokens, args.long_prompt = 2, 16, 128
        args.rounds, args.load_prompt, args.load_tokens = 1, 32, 8
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    print(f"model {args.model}, {args.kv_transfer_mode} over tcp, {args.threads} thread(s) for mixed, "
          f"{args.pd_threads} for each PD worker, "
          f"{f'CPU turns (decode waits <= {args.cpu_turn_wait_ms:g} ms)' if args.cpu_turns else 'no CPU turns'}, "
          f"worker env {args.worker_env or 'as is'}")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    workers: list[WorkerProcess] = []
    try:
        prefill, _, mixed = start_workers(args.model, log_dir, args, workers)
        asyncio.run(bench_load({"mixed": mixed, "PD": prefill}, args) if args.load else bench(prefill, mixed, args))
        sent = prefill.metric("disagg_kv_transfer_bytes_total", direction="sent")
        print(f"\nKV bytes sent by the prefill: {sent:,.0f} (logs in {log_dir})")
    except WorkerFailed as exc:
        print(f"bench_pd: {exc}", file=sys.stderr)
        return 1
    finally:
        for w in workers:
            w.stop(15.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
