"""Quantised projections on this CPU, against the engine's fp32 ones (a script, not a test; issue 18 item 3).

Two parts, one run:

1. Matmuls. Each projection shape of the model (per layer: qkv, o, gate_up,
   down; and the output projection lm_head), at decode-shaped (1, 8, 32 rows)
   and prefill-shaped (256, 1024 rows) inputs, timed as:
   - fp32 packed: oneDNN-packed fp32 weights, what the engine runs on a CPU,
   - fp32 strided: F.linear on the input-major fp32 weight (the unpacked path),
   - bf16 packed: oneDNN-packed bf16 weights and activations, where oneDNN runs bf16 here,
   - int8 dynamic: int8 weights (one scale per output channel) times int8
     activations quantised per call, FBGEMM's int32-accumulating kernel (how
     llama.cpp multiplies its Q4/Q8 weights: by Q8 activations),
   - int8 w-only: `torch._weight_int8pack_mm`, the same int8 weights and fp32
     activations, each weight tile dequantised inside the kernel,
   - int4 w-only gN: `torch._weight_int4pack_mm_for_cpu`, 4-bit weights with a
     scale and zero per group of N input channels (llama.cpp's Q4_1: groups of 32),
   - q4_1 x q8 (C prototype): the same int4 groups of 32 times activations
     quantised to int8 per 32 values, integer dot products: what llama.cpp
     does on AVX2, in benchmarks/q4_1_linear.c (one thread; compiled with gcc
     when the run starts).
   The weight-only kernels are timed up to --weight-only-max-rows rows (they
   are many times slower here; at prefill sizes one round takes minutes).
   Printed: microseconds per layer (the four projections summed) and for
   lm_head, the speed-up over fp32 packed, and the error (largest |y - y_fp32|
   over largest |y_fp32|, over the shapes).

2. The engine. The builtin model served by LLMEngine with its decoder layers'
   projections replaced by each scheme (the output projection stays as the
   engine packs it): output tokens per second at each batch size; the greedy
   tokens against fp32's (requests whose first token agrees, mean common
   prefix); and, teacher-forced over every prompt position, how often the
   most likely next token is fp32's, and the largest change of the log
   probability of the prompt's own next token. "int8 dynamic rows" scales each activation row to a
   maximum of 1 before the per-tensor quantisation, so each row gets its own
   scale (y = W(x / r) r is exact before quantisation).

Each round runs every method back to back, in alternating order; figures are
medians over rounds. The load average is printed as it goes.

    .venv/bin/python benchmarks/bench_quant.py [--rows 1 8 32 256 1024] [--batch-sizes 1 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench_engine import chat_prompts, load_average, time_ours
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import default_cache_dir, load_model, resolve_model_dir
from disagg.workers.engine.model_config import ModelConfig
from disagg.workers.engine.models.packing import PackedLinear, packing_available
from disagg.workers.engine.outputs import TokenLogprob
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.tokenizer import Tokenizer

CPU = torch.device("cpu")
INT8_MAX = 127
INT4_LEVELS = 15  # q in [0, 15]
INT4_MID = 8  # the int4 kernel dequantises (q - 8) * scale + zero
TINY = torch.finfo(torch.float32).tiny


# --- the quantised projections --------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in] int8, scales [out] fp32), symmetric per output channel."""
    scales = (weight.abs().amax(dim=1) / INT8_MAX).clamp(min=TINY)
    return torch.round(weight / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in/group, group] int32 in [0, 15], scales, lows [out, in/group]):
    w ~ q * scale + low, [min, max] of each group mapped onto the 16 levels (llama.cpp's Q4_1)."""
    n_out, n_in = weight.shape
    w = weight.reshape(n_out, n_in // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / INT4_LEVELS).clamp(min=TINY)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, INT4_LEVELS).to(torch.int32)
    return q, scales, low


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    return (q * scales[..., None] + lows[..., None]).reshape(q.shape[0], -1)


class Quantised(nn.Module):
    """y = matmul(x) + bias, for 2-D x [rows, in] fp32 (the engine's token-major activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = None if bias is None else bias.detach().clone()
        # What the kernel really multiplies, for check_kernels (the subclasses replace it).
        self.dequantised = weight.detach().float().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class Int8WeightOnly(Quantised):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.q, self.scales = quantize_int8(self.dequantised)
        self.dequantised = self.q.float() * self.scales[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scales)


class Int4WeightOnly(Quantised):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = 32) -> None:
        super().__init__(weight, bias)
        q, scales, lows = quantize_int4(self.dequantised, group)
        self.dequantised = dequantize_int4(q, scales, lows)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.flatten(1), 1)  # innerKTiles: unused on a CPU
        zeros = lows + INT4_MID * scales  # the kernel reads w = (q - 8) * scale + zero
        self.scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()  # [in/group, out, 2]
        self.group = group

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)


class Int8Dynamic(Quantised):
    """FBGEMM's dynamic linear: activations quantised per call to 7 bits (`reduce_range`:
    on AVX2 its u8 x s8 pair sums saturate int16 with 8 bits), one scale per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, per_row: bool = False) -> None:
        super().__init__(weight, bias)
        q, scales = quantize_int8(self.dequantised)
        self.dequantised = q.float() * scales[:, None]
        with warnings.catch_warnings():
            # The quantised-tensor type is deprecated, but it is still the only way into these kernels.
            warnings.simplefilter("ignore", UserWarning)
            q_weight = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros_like(q, dtype=torch.long)[:, 0], 0)
        self.packed = torch.ops.quantized.linear_prepack(q_weight, None)
        self.per_row = per_row

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.per_row:
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        r = x.abs().amax(dim=-1, keepdim=True).clamp(min=TINY)
        return torch.ops.quantized.linear_dynamic(x / r, self.packed, True) * r


@functools.cache
def q4_kernel() -> ctypes.CDLL:
    """benchmarks/q4_1_linear.c, compiled once per run (gcc, AVX2 + FMA)."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" or shutil.which("gcc") is None:
        raise SystemExit("the q4_1 x q8 prototype needs gcc and an AVX2 CPU; leave it out with --schemes")
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:  # a loaded library outlives its file
        out = Path(tmp) / "q4_1_linear.so"
        subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-o", str(out),
                        str(Path(__file__).with_name("q4_1_linear.c"))], check=True, timeout=120)
        lib = ctypes.CDLL(str(out))
    lib.q4_1_linear.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 7
    lib.q4_1_linear.restype = None
    return lib


class Q4_1xQ8(Quantised):
    """The C prototype: Q4_1 weights (groups of 32) times activations quantised to int8 per
    32 values, integer dot products, as llama.cpp computes its Q4_1 matmuls on AVX2."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        q, self.scales, self.lows = quantize_int4(self.dequantised, 32)
        self.dequantised = dequantize_int4(q, self.scales, self.lows)
        q8 = q.to(torch.uint8)
        self.packed = (q8[..., :16] | (q8[..., 16:] << 4)).contiguous()  # [out, in/32, 16]: q[j], q[j + 16]
        self.lib = q4_kernel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        (rows, n_in), n_out = x.shape, self.packed.shape[0]
        y = torch.empty(rows, n_out)
        xq = torch.empty(rows, n_in, dtype=torch.int8)
        dx, xsum = torch.empty(rows, n_in // 32), torch.empty(rows, n_in // 32)
        self.lib.q4_1_linear(x.data_ptr(), rows, n_in, n_out, self.packed.data_ptr(), self.scales.data_ptr(),
                             self.lows.data_ptr(), y.data_ptr(), xq.data_ptr(), dx.data_ptr(), xsum.data_ptr())
        return y


Make = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
SCHEMES: dict[str, Make] = {
    "int8 dynamic": Int8Dynamic,
    "int8 dynamic rows": lambda w, b: Int8Dynamic(w, b, per_row=True),
    "int8 w-only": Int8WeightOnly,
    "int4 w-only g32": Int4WeightOnly,
    "q4_1 x q8 (C prototype)": Q4_1xQ8,
}


def check_kernels() -> None:
    """Each weight-only kernel equals x @ its dequantised weight (so a layout mistake
    cannot pass for quantisation error); the dynamic one is within its 7-bit activations."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 128) / 128 ** 0.5, torch.randn(5, 128)
    for name, make in SCHEMES.items():
        m = make(weight, None)
        assert isinstance(m, Quantised)
        want = x @ m.dequantised.T
        bound = 1e-4 if "w-only" in name else 0.05  # the others quantise x too
        error = float((m(x) - want).abs().max() / want.abs().max())
        if error > bound:
            raise SystemExit(f"{name}: kernel differs from its dequantised weights by {error:.1e} > {bound}")


# --- part 1: matmuls -------------------------------------------------------------------------

def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of the model's projections."""
    return {
        "qkv": (config.q_size + 2 * config.kv_size, config.hidden_size),
        "o": (config.hidden_size, config.q_size),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size),
        "lm_head": (config.vocab_size, config.hidden_size),
    }


def matmul_methods(weight: torch.Tensor, rows: int, weight_only_max_rows: int) -> dict[str, tuple[nn.Module, torch.dtype]]:
    """method -> (the matmul, the activation dtype it takes), for one fp32 weight [out, in]."""
    strided = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    strided.weight = nn.Parameter(weight.t().contiguous().t())  # input-major, as layers.Linear stores it
    out: dict[str, tuple[nn.Module, torch.dtype]] = {
        "fp32 packed": (PackedLinear(weight, None), torch.float32),
        "fp32 strided": (strided, torch.float32),
    }
    if packing_available(CPU, torch.bfloat16):
        out["bf16 packed"] = (PackedLinear(weight.bfloat16(), None), torch.bfloat16)
    out |= {name: (make(weight, None), torch.float32) for name, make in SCHEMES.items()
            if "w-only" not in name or rows <= weight_only_max_rows}
    return out


def time_call(fn: nn.Module, x: torch.Tensor, min_seconds: float) -> float:
    """Mean seconds of one call, over as many calls as fill `min_seconds` (at least 3)."""
    fn(x)
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_seconds:
        fn(x)
        calls += 1
    return (time.perf_counter() - start) / calls


@dataclass(frozen=True)
class MatmulFigures:
    layer_s: float  # the four per-layer projections, summed
    head_s: float  # lm_head
    error: float  # max |y - y_fp32| / max |y_fp32| over the shapes


def measure_matmuls(shapes: dict[str, tuple[int, int]], rows: int, rounds: int, min_seconds: float,
                    weight_only_max_rows: int) -> dict[str, MatmulFigures]:
    """method -> its figures at `rows` input rows."""
    torch.manual_seed(rows)
    seconds: dict[str, dict[str, float]] = {}  # method -> shape -> median s
    errors: dict[str, float] = {}
    for shape, (n_out, n_in) in shapes.items():
        weight = torch.randn(n_out, n_in) / n_in ** 0.5  # std ~ 1/sqrt(in), as trained projections
        methods = matmul_methods(weight, rows, weight_only_max_rows)
        x = torch.randn(rows, n_in)
        samples: dict[str, list[float]] = {m: [] for m in methods}
        order = list(methods)
        with torch.inference_mode():
            reference = F.linear(x, weight)
            for m, (fn, dtype) in methods.items():
                error = float((fn(x.to(dtype)).float() - reference).abs().max() / reference.abs().max())
                errors[m] = max(errors.get(m, 0.0), error)
            for r in range(rounds):
                for m in order if r % 2 == 0 else reversed(order):
                    fn, dtype = methods[m]
                    samples[m].append(time_call(fn, x.to(dtype), min_seconds))
        for m, s in samples.items():
            seconds.setdefault(m, {})[shape] = statistics.median(s)
    return {m: MatmulFigures(sum(t for s, t in per_shape.items() if s != "lm_head"), per_shape["lm_head"], errors[m])
            for m, per_shape in seconds.items()}


MATMUL_HEADER = ("| rows | method | per layer (us) | vs fp32 packed | lm_head (us) | vs fp32 packed | error |\n"
                 "|---:|---|---:|---:|---:|---:|---:|")


def matmul_rows(rows: int, figures: dict[str, MatmulFigures]) -> list[str]:
    base = figures["fp32 packed"]
    return [f"| {rows} | {m} | {f.layer_s * 1e6:.0f} | {base.layer_s / f.layer_s:.2f}x "
            f"| {f.head_s * 1e6:.0f} | {base.head_s / f.head_s:.2f}x | {f.error:.1e} |" for m, f in figures.items()]


# --- part 2: the engine ----------------------------------------------------------------------

def quantised_engine(source: str, tokenizer: Tokenizer, make: Make | None, config: EngineConfig) -> LLMEngine:
    """LLMEngine on `source` with every decoder-layer nn.Linear replaced by make(weight, bias)."""
    loaded = load_model(source, torch.float32, CPU)
    if make is not None:
        layers = loaded.model.model.layers  # type: ignore[attr-defined]
        for parent in list(layers.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child.weight, child.bias))
    return LLMEngine(config, loaded, tokenizer)  # packs what is left: the output projection


def prompt_predictions(engine: LLMEngine, prompts: Sequence[list[int]]) -> tuple[list[int], list[float]]:
    """Teacher-forced, over every prompt position past the first: the most likely next
    token, and the log probability of the prompt's own next token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"predict-{i}", prompt, params)
    per_request: dict[str, list[TokenLogprob]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                per_request[out.request_id] = [p for p in out.prompt_logprobs if p is not None]
    ordered = [p for i in range(len(prompts)) for p in per_request[f"predict-{i}"]]
    return [p.top[0][0] for p in ordered], [p.logprob for p in ordered]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_engines(args: argparse.Namespace) -> list[str]:
    tokenizer = Tokenizer.from_dir(resolve_model_dir(args.model, default_cache_dir()))
    batch = max(args.batch_sizes)
    prompts = chat_prompts(tokenizer, batch)
    config = EngineConfig(model=args.model, device="cpu", dtype="float32", num_kv_blocks=batch * 16,
                          max_num_seqs=batch, max_model_len=256, enable_prefix_caching=False)
    schemes: dict[str, Make | None] = {"fp32 packed": None} | {s: SCHEMES[s] for s in args.schemes}
    engines = {name: quantised_engine(args.model, tokenizer, make, config) for name, make in schemes.items()}
    predictions = {name: prompt_predictions(engine, prompts) for name, engine in engines.items()}  # and warm-up
    tps: dict[tuple[str, int], list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    order = list(engines)
    for r in range(args.engine_rounds):
        for b in args.batch_sizes:
            for name in order if r % 2 == 0 else reversed(order):
                timing = time_ours(engines[name], prompts[:b], args.max_tokens)
                tps.setdefault((name, b), []).append(timing.tokens_per_second)
                if b == batch:
                    tokens[name] = timing.token_ids
            print(f"  round {r + 1}, batch {b} done (load average {load_average()})", flush=True)
    lines = ["| weights | " + " | ".join(f"batch {b} (tok/s) | vs fp32" for b in args.batch_sizes)
             + " | same first token | mean common prefix | same next token, prompts | max dlogprob, prompts |",
             "|---|" + "---:|---:|" * len(args.batch_sizes) + "---:|---:|---:|---:|"]
    ref_top, ref_logprob = predictions["fp32 packed"]
    for name in engines:
        cells = [f"{statistics.median(tps[name, b]):.1f} | "
                 f"{statistics.median(tps[name, b]) / statistics.median(tps['fp32 packed', b]):.2f}x"
                 for b in args.batch_sizes]
        prefixes = [common_prefix(a, b) for a, b in zip(tokens[name], tokens["fp32 packed"])]
        top, logprob = predictions[name]
        same_next = sum(a == b for a, b in zip(top, ref_top))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(p > 0 for p in prefixes)}/{batch} "
                     f"| {statistics.mean(prefixes):.1f}/{args.max_tokens} | {same_next}/{len(ref_top)} "
                     f"| {max(abs(a - b) for a, b in zip(logprob, ref_logprob)):.2f} |")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m", help="whose projection shapes to time, and serve")
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 32, 256, 1024], help="input rows per matmul")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per shape (default %(default)s)")
    p.add_argument("--min-seconds", type=float, default=0.05, help="time spent per method per round")
    p.add_argument("--weight-only-max-rows", type=int, default=32,
                   help="time the weight-only kernels up to this many rows (default %(default)s)")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8], help="engine: concurrent requests")
    p.add_argument("--schemes", nargs="*", choices=tuple(SCHEMES), default=list(SCHEMES),
                   help="engine: the schemes served besides fp32")
    p.add_argument("--max-tokens", type=int, default=16, help="engine: new tokens per request, greedy")
    p.add_argument("--engine-rounds", type=int, default=2, help="engine: timed rounds (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s, "
                   "as benchmarks/bench_engine.py: one thread degrades gracefully on a shared machine)")
    args = p.parse_args(argv)
    if (args.rows and min(args.rows) < 1) or (args.batch_sizes and min(args.batch_sizes) < 1) \
            or args.rounds < 1 or args.engine_rounds < 1 or args.threads < 1 or args.max_tokens < 2:
        p.error("--rows, --batch-sizes, the rounds and --threads must be positive, --max-tokens at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    check_kernels()
    shapes = projection_shapes(ModelConfig.from_dir(resolve_model_dir(args.model, default_cache_dir())))
    print("command:", shlex.join(sys.orig_argv))
    print(f"load average before (1/5/15 min): {load_average()}")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; model {args.model}, "
          f"projections (out, in) {shapes}")
    lines = [MATMUL_HEADER] if args.rows else []
    for rows in args.rows:
        new = matmul_rows(rows, measure_matmuls(shapes, rows, args.rounds, args.min_seconds,
                                                args.weight_only_max_rows))
        lines += new
        print(f"{rows} rows (load average {load_average()}):\n" + "\n".join(new), flush=True)
    if args.batch_sizes:
        lines += ["", *measure_engines(args)]
    print(f"load average after (1/5/15 min): {load_average()}\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
