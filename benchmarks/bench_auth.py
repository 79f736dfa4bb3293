"""The cost of the cluster key and of TLS: link time and TTFT of a prefill/decode
pair on real `disagg serve` processes on loopback, with --insecure, with a key,
and with a key and mutual TLS (a script, not a test). The pairs run one after
the other, so they do not compete for the cores.

Link time is one `disagg link` call (a signed LinkInstance whose handler opens
the transfer connections, each with the challenge-response when keyed), after
an unlink; TTFT is a streaming client's, one request at a time.

    .venv/bin/python benchmarks/bench_auth.py [--model builtin:smollm2-135m] [--links 10] [--requests 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_pd import SERVED, STARTUP_S, Prompts, ms, stream_one

from disagg.workers.local import WorkerFailed, WorkerProcess, link, spawn_worker, unlink
from disagg.testing.pki import write_tls_folder
from disagg.workers.security.key import ClusterKey
from disagg.workers.security.tls import TLS_SERVER_NAME


def link_times(decode: WorkerProcess, prefill: WorkerProcess, count: int) -> list[float]:
    """Seconds of `count` links, each after an unlink."""
    times = []
    for _ in range(count):
        if errors := unlink(decode, prefill):
            raise WorkerFailed(f"unlink: {errors}")
        began = time.perf_counter()
        if error := link(decode, prefill):
            raise WorkerFailed(f"link: {error}")
        times.append(time.perf_counter() - began)
    return times


async def ttfts(prefill: WorkerProcess, count: int, prompt_len: int, id_range: int) -> list[float]:
    prompts = Prompts(id_range)
    async with httpx.AsyncClient(timeout=600.0) as client:
        await stream_one(client, prefill, prompts.next(prompt_len), 2)  # warm-up
        return [(await stream_one(client, prefill, prompts.next(prompt_len), 2)).ttft_s for _ in range(count)]


def measure(args: argparse.Namespace, label: str, key_file: Path | None, tls_dir: Path | None,
            log_dir: Path) -> tuple[list[float], list[float]]:
    """Start a pair (keyed when `key_file`, over TLS when `tls_dir`), link it, measure, stop it."""
    extra = ["--served-model-name", SERVED, "--max-model-len", "1024"]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    workers = [spawn_worker(role, args.model, log_dir / f"{label}-{role}.log", extra, env=env, key_file=key_file,
                            tls_dir=tls_dir) for role in ("decode", "prefill")]
    try:
        for w in workers:
            w.wait_loaded(STARTUP_S)
        decode, prefill = workers
        if error := link(decode, prefill):
            raise WorkerFailed(f"link: {error}")
        links = link_times(decode, prefill, args.links)
        deadline = time.monotonic() + 30
        while httpx.get(f"{prefill.base_url}/ready", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise WorkerFailed("the prefill is not ready 30 s after its link")
            time.sleep(0.1)
        return links, asyncio.run(ttfts(prefill, args.requests, args.prompt_len, args.id_range))
    finally:
        for w in workers:
            w.stop(15.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker process (default %(default)s)")
    p.add_argument("--links", type=int, default=10, help="links timed per pair (default %(default)s)")
    p.add_argument("--requests", type=int, default=30, help="requests timed per pair (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--id-range", type=int, default=20000, help="prompt ids are 100 + [0, this) (default %(default)s)")
    args = p.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    key_file = log_dir / "cluster.key"
    ClusterKey.generate().write(key_file)
    tls_dir = write_tls_folder(log_dir / "tls", [TLS_SERVER_NAME])
    pairs = (("insecure", None, None), ("keyed", key_file, None), ("keyed+tls", key_file, tls_dir))
    try:
        results = {label: measure(args, label, kf, tls, log_dir) for label, kf, tls in pairs}
    except WorkerFailed as exc:
        print(f"bench_auth: {exc}", file=sys.stderr)
        return 1
    print(f"\nmodel {args.model}, PUSH over tcp, {args.threads} thread(s) per worker; mean / p90 in ms")
    print(f"{'pair':10s} {'link (' + str(args.links) + ')':>19s}   {'TTFT (' + str(args.requests) + ')':>19s}")
    for label, (links, firsts) in results.items():
        print(f"{label:10s} {ms(links)}   {ms(firsts)}")
    print(f"(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
