"""The cost of constrained decoding (structured outputs), on a mixed worker and on a
PD pair of real `disagg serve` processes (a script, not a test). On each target,
all at once and greedy:

a. N unconstrained requests alone (`ignore_eos`, each as many tokens as the
   warm-up's constrained request made, so both kinds run equally long);
b. the same N unconstrained requests while N constrained ones (a JSON schema
   of a fixed-length array, `guided_json`) share their batch;
b0. the control: the N unconstrained requests beside N other unconstrained
   ones, the same batch size as (b) without a grammar;
c. the N constrained requests alone.

It prints output tokens/s of each phase, the unconstrained requests' mean time
per output token (TPOT) in (a), (b0) and (b): (b) / (b0) is what constrained
neighbours cost unconstrained requests beyond a bigger batch; and the
constrained requests' TPOT in (c) against the unconstrained in (a): the
overhead per token of the grammar (mask and matcher), in ms and %. Each figure
is the median of --rounds rounds, which run the phases in alternating order.
Last, the engine's own work per constrained token, timed in this process, free
of the machine's load: what a constrained row adds to each step.

    .venv/bin/python benchmarks/bench_constrained.py [--model builtin:smollm2-135m | --tiny] [--requests 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_pd import Prompts, Sample, start_workers, stream_one

from disagg.testing.tiny_model import build_tiny_model
from disagg.workers.config import default_threads
from disagg.workers.engine.grammar import GrammarKind, Grammars, build_grammar
from disagg.workers.engine.loader import default_cache_dir, resolve_model_dir
from disagg.workers.engine.model_config import ModelConfig
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.local import WorkerFailed, WorkerProcess

PROMPT_TOKENS = 32
RUNAWAY_TOKENS = 1024
# The constrained output: a fixed number of records, so every constrained request makes
# about as many tokens as an unconstrained one, whatever the weights, and always closes.
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tag": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"], "additionalProperties": False}


def schema(items: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": items,
                                                       "maxItems": items}},
            "required": ["items"], "additionalProperties": False}


@dataclass(frozen=True)
class Phase:
    """One phase on one target: output tokens/s over its wall time; the samples of each kind."""

    tok_s: float
    plain: list[Sample]  # unconstrained requests
    constrained: list[Sample]

    @staticmethod
    def tpot_ms(samples: list[Sample]) -> float:
        return statistics.mean(s.tpot_s for s in samples if s.tpot_s is not None) * 1e3


async def run_phase(worker: WorkerProcess, prompts: Prompts, items: int, plain: int, constrained: int,
                    plain_tokens: int) -> Phase:
    """`plain` unconstrained requests of `plain_tokens` tokens and `constrained` constrained ones
    (`items` records), all sent at once."""
    fields = {"ignore_eos": False, "guided_json": schema(items)}
    # A constrained request ends with its grammar; its max_tokens only guards against a runaway.
    jobs = [(plain_tokens, None)] * plain + [(RUNAWAY_TOKENS, fields)] * constrained
    async with httpx.AsyncClient(timeout=600.0) as client:
        began = time.perf_counter()
        samples = await asyncio.gather(*(stream_one(client, worker, prompts.next(PROMPT_TOKENS), max_tokens, f)
                                         for max_tokens, f in jobs))
        wall = time.perf_counter() - began
    return Phase(sum(s.tokens for s in samples) / wall, samples[:plain], samples[plain:])


# name -> (unconstrained, constrained) requests, as multiples of N
PHASES = {"a": (1, 0), "b0": (2, 0), "b": (1, 1), "c": (0, 1)}
COLUMNS = ("a tok/s", "b0 tok/s", "b tok/s", "c tok/s", "a TPOT", "b0 TPOT", "b TPOT", "c TPOT")


def figures(phases: dict[str, Phase]) -> dict[str, float]:
    """One round's figures: every phase's tok/s; the unconstrained TPOT in a, b0, b and the constrained in c."""
    out = {f"{name} tok/s": phase.tok_s for name, phase in phases.items()}
    out.update({f"{name} TPOT": Phase.tpot_ms(phases[name].plain) for name in ("a", "b0", "b")})
    out["c TPOT"] = Phase.tpot_ms(phases["c"].constrained)
    return out


async def bench(targets: dict[str, WorkerProcess], args: argparse.Namespace) -> list[str]:
    """The markdown table's rows, one per target: the median of each figure over the rounds."""
    prompts = Prompts(args.id_range)
    n = args.requests
    rows = []
    for name, worker in targets.items():
        # First-call allocations and the grammar's compilation; the constrained output's length.
        warm = await run_phase(worker, prompts, args.items, 1, 1, 16)
        tokens = warm.constrained[0].tokens
        print(f"{name}: warm-up (one of each) {warm.tok_s:.1f} tok/s; unconstrained requests make {tokens} tokens",
              flush=True)
        rounds = []
        for r in range(args.rounds):
            order = list(PHASES.items()) if r % 2 == 0 else list(reversed(PHASES.items()))  # drift hits both ends
            phases = {phase: await run_phase(worker, prompts, args.items, plain * n, constrained * n, tokens)
                      for phase, (plain, constrained) in order}
            rounds.append(figures(phases))
            print(f"{name} round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[-1].items()), flush=True)
        f = {k: statistics.median(x[k] for x in rounds) for k in COLUMNS}
        a, b0, b, c = f["a TPOT"], f["b0 TPOT"], f["b TPOT"], f["c TPOT"]
        rows.append(f"| {name} | {tokens} | " + " | ".join(f"{f[k]:.1f}" for k in COLUMNS)
                    + f" | {100 * (b / b0 - 1):+.1f}% | {c - a:+.1f} ms ({100 * (c / a - 1):+.1f}%) |")
    return rows


HEADER = ("| target | tokens per request | " + " | ".join(COLUMNS) + " | b vs b0 (unconstrained TPOT) "
          "| constrained vs unconstrained per token (c vs a) |\n|" + "---|" * (len(COLUMNS) + 4))


def mask_cost_ms(model_dir: Path, items: int, repeats: int = 20) -> tuple[float, int]:
    """In this process, the engine's own work per constrained token (the mask, then advancing
    the matcher) over a valid output of `schema(items)`: ms per token, and the vocabulary."""
    tokenizer = Tokenizer.from_dir(model_dir)
    grammars = Grammars(tokenizer, ModelConfig.from_dir(model_dir).vocab_size)
    grammar = build_grammar(GrammarKind.JSON_SCHEMA, schema(items))
    instance = {"items": [{"id": 100 + i, "tag": "beta", "ok": i % 2 == 0} for i in range(items)]}
    tokens = tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
    grammars.constraint(grammar)  # compiled once, as the engine's cache does
    began = time.perf_counter()
    for _ in range(repeats):
        constraint = grammars.constraint(grammar)
        for token in tokens:
            constraint.allowed()
            constraint.advance(token)
    return (time.perf_counter() - began) / (repeats * len(tokens)) * 1e3, grammars.vocab_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead of --model")
    p.add_argument("--requests", type=int, default=4, help="N: requests of each kind per phase (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the four phases; medians are shown")
    p.add_argument("--items", type=int, default=4, help="records in a constrained output (default %(default)s)")
    p.add_argument("--kv-transfer-mode", choices=("PUSH", "PULL"), default="PUSH")
    p.add_argument("--threads", type=int, default=default_threads(), help="compute threads of the mixed worker")
    p.add_argument("--pd-threads", type=int, default=default_threads(),
                   help="compute threads of the prefill and of the decode")
    p.add_argument("--worker-env", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--id-range", type=int, default=20000, help="prompt token ids are 100 + [0, this)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so the workers are stopped
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-constrained-"))
    model = args.model
    if args.tiny:
        model = str(build_tiny_model("llama", log_dir / "tiny", context=2048))
        args.id_range = 200  # its vocabulary has 320 tokens
    print(f"model {model}, PD over tcp in {args.kv_transfer_mode}, {args.threads} thread(s) for mixed, "
          f"{args.pd_threads} for each PD worker; N = {args.requests}; load average {os.getloadavg()}")
    workers: list[WorkerProcess] = []
    try:
        prefill, _, mixed = start_workers(model, log_dir, args, workers)
        rows = asyncio.run(bench({"mixed": mixed, "PD": prefill}, args))
    except WorkerFailed as exc:
        print(f"bench_constrained: {exc}", file=sys.stderr)
        return 1
    finally:
        for w in workers:
            w.stop(15.0)
    per_token, vocab = mask_cost_ms(resolve_model_dir(model, default_cache_dir()), args.items)
    print(f"\nTPOT in ms (mean over the unconstrained requests in a, b0, b; over the constrained in c), "
          f"medians of {args.rounds} rounds; load average at the end {os.getloadavg()}\n")
    print(HEADER)
    print("\n".join(rows))
    print(f"\nThe engine's own work per constrained token (mask over {vocab} tokens, then the matcher's "
          f"advance), in this process: {per_token:.3f} ms")
    print(f"\n(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
