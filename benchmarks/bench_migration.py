"""Mid-stream migration (a script, not a test): a prefill and two decodes; streams run on one
decode, which is killed (SIGKILL) or stopped (SIGSTOP) mid-way; the time from the fault to
each stream's next token, against the streams' usual time per token.

    .venv/bin/python benchmarks/bench_migration.py [--model builtin:smollm2-135m] [--streams 4] [--fault kill]
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
from pathlib import Path

import httpx
from bench_pd import FIRST_ID, SERVED, STARTUP_S

from disagg.workers.config import default_threads
from disagg.workers.local import WorkerFailed, WorkerProcess, link, spawn_worker
from disagg.workers.security.key import ClusterKey


async def stream(client: httpx.AsyncClient, prefill: WorkerProcess, prompt: list[int], max_tokens: int,
                 times: list[float]) -> int:
    """One streamed completion; the arrival time of each token into `times`; the tokens."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    n = 0
    async with client.stream("POST", f"{prefill.base_url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                got = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
                times += [time.perf_counter()] * got
                n += got
    return n


async def run(prefill: WorkerProcess, victim: WorkerProcess, spare: WorkerProcess,
              args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Each stream's wait from the fault to its next token, and the usual gaps between tokens."""
    traces: list[list[float]] = [[] for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=600.0) as client:
        tasks = [asyncio.create_task(stream(client, prefill, [FIRST_ID + 97 * s + i for i in range(args.prompt_len)],
                                            args.max_tokens, traces[s])) for s in range(args.streams)]
        while min(len(t) for t in traces) < args.max_tokens // 4:
            await asyncio.sleep(0.01)
        # The spare joins once the streams run on the victim (the router would spread them otherwise).
        if error := await asyncio.to_thread(link, spare, prefill):
            raise WorkerFailed(f"link: {error}")
        fault = time.perf_counter()
        victim.process.send_signal(signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        counts = await asyncio.gather(*tasks)
    assert counts == [args.max_tokens] * args.streams, f"every stream completes: {counts}"
    across = [next(t for t in trace if t > fault) - fault for trace in traces]
    usual = [b - a for trace in traces for a, b in zip(trace, trace[1:]) if b > a and not a < fault < b]
    return across, usual


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--fault", choices=("kill", "stop"), default="kill")
    args = p.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-migration-"))
    key_file = log_dir / "cluster.key"
    ClusterKey.generate().write(key_file)
    extra = ["--served-model-name", SERVED, "--max-model-len", "2048"]
    threads = default_threads()
    workers = [spawn_worker(role, args.model, log_dir / f"{name}.log", extra, key_file=key_file, threads=threads)
               for name, role in (("victim", "decode"), ("spare", "decode"), ("prefill", "prefill"))]
    victim, spare, prefill = workers
    try:
        for w in workers:
            w.wait_loaded(STARTUP_S)
        if error := link(victim, prefill):
            raise WorkerFailed(f"link: {error}")
        across, usual = asyncio.run(run(prefill, victim, spare, args))
        moves = prefill.metric("disagg_request_migrations_total")
    except WorkerFailed as exc:
        print(f"bench_migration: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.fault == "stop" and victim.process.poll() is None:
            victim.process.send_signal(signal.SIGCONT)
        for w in workers:
            w.stop(15.0)
    print(f"\n{args.streams} streams of {args.max_tokens} tokens, {args.fault} of their decode after "
          f"{args.max_tokens // 4} tokens; every stream completed, {moves:.0f} moved")
    print(f"fault to next token: median {statistics.median(across) * 1e3:.0f} ms, max {max(across) * 1e3:.0f} ms; "
          f"usual time per token: median {statistics.median(usual) * 1e3:.1f} ms")
    print(f"(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
