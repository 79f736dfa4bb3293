"""Where a serving worker's CPU goes (a script, not a test): one `disagg serve
--role mixed` worker under a decode-bound wave (streaming completions of short
prompts, many at once), its tokens per second and its CPU time per output
token (from /proc/PID/stat), and with --pyspy a py-spy profile of the last
round summarised per thread:

- samples per thread (the engine loop, the event loop that serves HTTP and
  gRPC, the rest);
- per thread, the innermost function of this project in each sample (what of
  ours the time is under: a projection kernel, paged attention, the SSE
  writer), and the package of the innermost frame (torch, uvicorn, h11,
  asyncio...).

    .venv/bin/python benchmarks/profile_serving.py [--concurrency 32] [--prompt-tokens 16] [--max-tokens 128] \\
        [--rounds 2] [--dtype auto] [--pyspy]        # --pyspy needs `pip install py-spy` and ptrace rights on the worker
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench_pd import SERVED, Prompts, Sample, run_load
from bench_serving import running_mixed

from disagg.testing.processes import cpu_seconds
from disagg.workers.local import WorkerProcess

FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
# py-spy names a file relative to its sys.path entry: `workers/...` in an editable install, `disagg/...` otherwise.
PROJECT = ("workers", "disagg")


def wave(worker: WorkerProcess, prompts: Prompts, prompt_tokens: int, concurrency: int,
         max_tokens: int) -> list[Sample]:
    """`concurrency` streams at once, each with a fresh prompt."""
    return asyncio.run(run_load(worker, [prompts.next(prompt_tokens) for _ in range(concurrency)], concurrency,
                                max_tokens))


def is_ours(file: str) -> bool:
    return bool(file) and Path(file).parts[0] in PROJECT


def package_of(file: str) -> str:
    """The top-level package (or module) of a frame's file; this project's files by their module."""
    if is_ours(file):
        return "disagg:" + Path(file).stem
    return Path(file).parts[0].removesuffix(".py") if file else "?"


def summarise(raw: Path, top: int) -> str:
    """py-spy's raw output (`frame;frame;... count`, the thread first) per thread and frame."""
    threads: Counter[str] = Counter()
    ours: defaultdict[str, Counter[str]] = defaultdict(Counter)
    leaves: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        parsed = [m for m in map(FRAME.match, frames) if m]
        n = int(count)
        threads[thread] += n
        own = [m for m in parsed if is_ours(m["file"])]
        ours[thread][f"{own[-1]['function']} ({Path(own[-1]['file']).name})" if own else "(none of ours)"] += n
        leaves[thread][package_of(parsed[-1]["file"]) if parsed else "?"] += n
    total = sum(threads.values())
    out = [f"{total} samples"]
    for thread, n in threads.most_common():
        out.append(f"\n{thread}: {n} samples ({100 * n / total:.1f}%)")
        out.append("  innermost function of ours: " + ", ".join(f"{k} {v}" for k, v in ours[thread].most_common(top)))
        out.append("  package of the innermost frame: " + ", ".join(f"{k} {v}" for k, v in leaves[thread].most_common(top)))
    return "\n".join(out)


def record(pid: int, out: Path) -> subprocess.Popen[bytes]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "50", "--threads", "--nonblocking",
                             "-f", "raw", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="the worker's --dtype (default: auto)")
    p.add_argument("--pyspy", action="store_true", help="profile the last round with py-spy")
    p.add_argument("--top", type=int, default=8, help="entries per list in the profile summary")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="profile-serving-"))
    raw = logs / "pyspy.txt"
    print(f"{args.concurrency} streams x {args.prompt_tokens} prompt tokens x {args.max_tokens} output tokens; "
          f"logs in {logs}", flush=True)
    with running_mixed(args.model, logs, ["--served-model-name", SERVED, "--dtype", args.dtype]) as worker:
        prompts = Prompts(20000)
        wave(worker, prompts, args.prompt_tokens, 4, 8)  # warm-up
        pid = worker.process.pid
        for r in range(1, args.rounds + 1):
            spy = record(pid, raw) if args.pyspy and r == args.rounds else None
            time.sleep(1.0 if spy else 0.0)  # py-spy attaches before the wave
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            samples = wave(worker, prompts, args.prompt_tokens, args.concurrency, args.max_tokens)
            cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
            tokens = sum(s.tokens for s in samples)
            print(f"round {r}: {tokens / wall:.1f} tok/s, worker CPU {cpu:.1f} s over {wall:.1f} s, "
                  f"{1000 * cpu / tokens:.2f} ms of CPU per output token (load average "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
            if spy:
                spy.send_signal(signal.SIGINT)
                _, err = spy.communicate(timeout=60)
                if spy.returncode not in (0, -signal.SIGINT) or not raw.exists():
                    print(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")
                    return 1
                print(summarise(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
