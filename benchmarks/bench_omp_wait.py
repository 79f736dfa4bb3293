"""Two processes sharing the cores, each running decode-sized matmuls with
torch: steps per second under libgomp's default (spin, then sleep) and
OMP_WAIT_POLICY=PASSIVE, with N threads each (a script, not a test).

    .venv/bin/python benchmarks/bench_omp_wait.py [--threads 2 1] [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# NOTE: the policy is read once when torch loads, so each case runs in fresh child processes.
POLICIES = {"default": None, "PASSIVE": "PASSIVE"}


def child(threads: int, seconds: float) -> None:
    import torch

    torch.set_num_threads(threads)
    x, w = torch.randn(32, 576), torch.randn(576, 1536)  # [batch, hidden] @ [hidden, mlp] of SmolLM2-135M
    steps, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(30):  # a step: many small parallel regions
            torch.relu(x @ w)
        steps += 1
        time.sleep(0.0005)  # the Python between steps
    print(steps / seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="threads per process (default %(default)s)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.seconds)
        return 0
    for name, policy in POLICIES.items():
        for threads in args.threads:
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            cmd = [sys.executable, __file__, "--child", str(threads), "--seconds", str(args.seconds)]
            procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(args.processes)]
            rates = [float(proc.communicate(timeout=args.seconds + 120)[0]) for proc in procs]
            print(f"{name:8s} {threads} thread(s) x {args.processes} processes: steps/s "
                  f"{' + '.join(f'{r:.0f}' for r in rates)} = {sum(rates):.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
