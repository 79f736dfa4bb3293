"""GPU check of the engine (a script to run on a CUDA machine, not a test).

1. Accuracy: the embedded default (or --model) greedy on CUDA bf16 against the
   CPU fp32 reference: greedy token agreement over a few chat prompts, and the
   max abs difference of the first step's logits, next to the same difference
   for transformers' own bf16 forward on the GPU (the error bf16 itself costs).
   Fails (exit 1) when our first-step logit error exceeds --logit-tolerance
   times transformers', or a prompt's first greedy token differs although the
   reference's top-2 margin is wider than twice our logit error there (a
   near-tie may flip under bf16 rounding; a clear winner may not).
2. Throughput: a random Llama of the 1B shape (hidden 2048, 16 layers, 32
   heads, 8 KV heads, intermediate 8192, vocab 128256; built from a config,
   saved as safetensors in a temp dir, loaded with our loader) at batch 1, 8,
   32 and 128, against transformers `generate` on the same weights and GPU,
   and against vLLM's offline `LLM.generate` on the same folder where vLLM
   imports (a child process, its memory capped by --vllm-gpu-fraction; where it
   does not import, a line says so).

The process never takes more than --max-gib of GPU memory (a cap on torch's
allocator, and a KV pool sized within it).

    python benchmarks/gpu_check_engine.py [--model builtin:smollm2-135m] [--batch-sizes 1 8 32 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench_engine import chat_prompts, load_average, markdown_table, measure, time_ours, warm_up
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.forward_batch import ForwardBatch
from disagg.workers.engine.kv_cache import KVCache, KVCacheSpec
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import LoadedModel, ModelLoadError, default_cache_dir, load_model, resolve_model_dir
from disagg.workers.engine.tokenizer import Tokenizer

CUDA = torch.device("cuda")
CPU = torch.device("cpu")

# Llama 3.2 1B's shape and RoPE settings; weights are random.
LLAMA_1B_SHAPE: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)


# --- 1. accuracy ------------------------------------------------------------------


def first_step_logits(loaded: LoadedModel, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 logits [vocab] after the prompt's last token: one prefill forward
    through a private paged cache whose blocks are 0..n-1 in order."""
    weight = next(loaded.model.parameters())
    device, dtype = weight.device, weight.dtype
    cfg = loaded.config
    num_blocks = -(-len(prompt) // block_size)
    kv = KVCache(KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype), num_blocks, device)
    positions = torch.arange(len(prompt), device=device)  # [T]; with blocks in order, slot == position
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt, device=device),
        positions=positions,
        slot_mapping=positions,
        query_lens=[len(prompt)],
        context_lens=torch.tensor([len(prompt)], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],  # [1, num_blocks]
        logits_indices=torch.tensor([len(prompt) - 1], device=device),
    )
    with torch.inference_mode():
        hidden = loaded.model(batch, kv.tensor)  # [T, hidden]
        return loaded.model.compute_logits(hidden[batch.logits_indices])[0].float().cpu()


def transformers_first_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """float32 logits [vocab] after the prompt's last token, by transformers."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device=model.device), logits_to_keep=1)
    return out.logits[0, -1].float().cpu()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_accuracy(args: argparse.Namespace) -> bool:
    """Prints the comparison; True when it passes (or cannot run here)."""
    from transformers import AutoModelForCausalLM

    print(f"\n1. accuracy: {args.model}, CUDA bfloat16 against the CPU float32 reference")
    try:
        model_dir = resolve_model_dir(args.model, default_cache_dir())
    except (ModelLoadError, FileNotFoundError, ImportError) as exc:  # ImportError: no gguf to convert with
        print(f"  skipped: {exc}")
        return True
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = chat_prompts(tokenizer, args.prompts)
    reference = load_model(args.model, torch.float32, CPU)
    ours = load_model(args.model, torch.bfloat16, CUDA)
    theirs: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    theirs = theirs.to(CUDA).eval()

    def engine(loaded: LoadedModel, device: str, dtype: str) -> LLMEngine:
        config = EngineConfig(model=args.model, device=device, dtype=dtype, kv_cache_memory_bytes=512 << 20,
                              max_model_len=2048, max_num_seqs=len(prompts))
        return LLMEngine(config, loaded, tokenizer)

    cpu_tokens = time_ours(engine(reference, "cpu", "float32"), prompts, args.accuracy_tokens).token_ids
    gpu_tokens = time_ours(engine(ours, "cuda", "bfloat16"), prompts, args.accuracy_tokens).token_ids
    ok = True
    print(f"  {'prompt':>6s} {'same greedy prefix':>18s} {'max |dlogit| ours':>17s} {'transformers bf16':>17s} "
          f"{'fp32 top-2 margin':>17s}")
    diffs = []
    for i, (prompt, a, b) in enumerate(zip(prompts, cpu_tokens, gpu_tokens)):
        ref = first_step_logits(reference, prompt)
        ours_diff = float((first_step_logits(ours, prompt) - ref).abs().max())
        theirs_diff = float((transformers_first_logits(theirs, prompt) - ref).abs().max())
        diffs.append((ours_diff, theirs_diff))
        top2 = ref.topk(2).values
        margin = float(top2[0] - top2[1])
        print(f"  {i:6d} {common_prefix(a, b):11d} / {len(a):<4d} {ours_diff:17.4f} {theirs_diff:17.4f} {margin:17.4f}")
        ok &= a[0] == b[0] or margin <= 2 * ours_diff
    worst_ours, worst_theirs = max(d[0] for d in diffs), max(d[1] for d in diffs)
    identical = sum(a == b for a, b in zip(cpu_tokens, gpu_tokens))
    ok &= worst_ours <= args.logit_tolerance * max(worst_theirs, 1e-3)
    print(f"  greedy outputs identical: {identical}/{len(prompts)} prompts ({args.accuracy_tokens} tokens); "
          f"first-step max |dlogit|: ours {worst_ours:.4f}, transformers bf16 {worst_theirs:.4f}")
    print(f"  accuracy: {'PASS' if ok else 'FAIL'} (ours <= {args.logit_tolerance} x transformers' bf16 error; "
          f"first tokens equal unless the fp32 top-2 margin is within 2 x our error)")
    del reference, ours, theirs
    torch.cuda.empty_cache()
    return ok


# --- 2. throughput ----------------------------------------------------------------


@dataclass(frozen=True)
class RandomLlama:
    folder: Path
    hf_model: Any  # the transformers model the folder was saved from, on the GPU


def build_random_llama(dest: Path) -> RandomLlama:
    """A random bf16 Llama of the 1B shape, made on the GPU and saved as safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with CUDA:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B_SHAPE), dtype=torch.bfloat16)
    model = model.to(CUDA).eval()
    model.save_pretrained(dest)
    return RandomLlama(dest, model)


def check_throughput(args: argparse.Namespace) -> None:
    print(f"\n2. throughput: random Llama of the 1B shape, bfloat16, prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each (greedy, no early stop), {args.repeats} rounds, median")
    with tempfile.TemporaryDirectory(prefix="gpu-check-llama-") as tmp:  # kept for vLLM at the end
        built = build_random_llama(Path(tmp))
        params = sum(p.numel() for p in built.hf_model.parameters())
        config = EngineConfig(model=str(built.folder), device="cuda", dtype="bfloat16",
                              kv_cache_memory_bytes=args.kv_gib << 30, max_num_seqs=max(args.batch_sizes),
                              max_num_batched_tokens=args.max_batched_tokens,
                              max_model_len=args.prompt_len + args.max_tokens + 16, enable_prefix_caching=False)
        engine = LLMEngine(config, load_model(str(built.folder), torch.bfloat16, CUDA))
        print(f"  {params / 1e9:.2f} B parameters; KV pool {engine.kv_cache.nbytes / 2**30:.1f} GiB; "
              f"max_num_batched_tokens {args.max_batched_tokens}")
        gen = torch.Generator().manual_seed(0)
        # [B, prompt_len] ordinary token ids, one row per request; equal lengths, so no padding
        prompts = torch.randint(1000, 100000, (max(args.batch_sizes), args.prompt_len), generator=gen).tolist()
        pad_id = 0
        warm_up(engine, built.hf_model, prompts, args.batch_sizes, args.warmup_tokens, pad_id)
        rows = []
        for batch in args.batch_sizes:
            row = measure(engine, built.hf_model, prompts, batch, args.max_tokens, args.repeats, pad_id)
            rows.append(row)
            print(f"  batch {batch:3d}: ours {row.ours_tps:8.1f} tok/s, transformers {row.theirs_tps:8.1f} tok/s, "
                  f"{row.ratio:5.2f}x; ours TTFT {row.ttft_ms:6.0f} ms, TPOT {row.tpot_ms:6.1f} ms", flush=True)
        print(f"  peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB\n")
        print(markdown_table(rows, {LLAMA_1B_SHAPE["eos_token_id"]}))
        compare_with_vllm(args, built.folder, prompts, {row.batch: row.ours_tps for row in rows})


# vLLM in a child process: its engine takes its own share of the GPU and leaves with it.
_VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, prompts, batch_sizes, max_tokens, fraction = json.loads(sys.argv[1])
llm = LLM(model=folder, dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=fraction,
          max_model_len=len(prompts[0]) + max_tokens + 16, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
for batch in batch_sizes:
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]]
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print("VLLM " + json.dumps({"batch": batch, "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds}))
"""


def compare_with_vllm(args: argparse.Namespace, folder: Path, prompts: list[list[int]],
                      ours: dict[int, float]) -> None:
    """vLLM's offline throughput on the same weights, prompts and batch sizes, and ours / vLLM."""
    if importlib.util.find_spec("vllm") is None:
        print("  vLLM: not installed for this interpreter; the comparison with it is skipped")
        return
    spec = json.dumps([str(folder), prompts, args.batch_sizes, args.max_tokens, args.vllm_gpu_fraction])
    try:
        run = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, spec], capture_output=True, text=True,
                             timeout=args.vllm_timeout_s)
    except subprocess.TimeoutExpired:
        print(f"  vLLM: no result within {args.vllm_timeout_s:.0f} s")
        return
    results = {r["batch"]: r["tok_s"] for r in (json.loads(line[5:]) for line in run.stdout.splitlines()
                                                 if line.startswith("VLLM "))}
    if run.returncode != 0 or not results:
        print(f"  vLLM: failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        return
    print("\n| batch | ours (tok/s) | vLLM (tok/s) | ours / vLLM |\n|---:|---:|---:|---:|")
    for batch, theirs in sorted(results.items()):
        print(f"| {batch} | {ours[batch]:.1f} | {theirs:.1f} | {ours[batch] / theirs:.2f}x |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m", help="model of the accuracy check")
    p.add_argument("--prompts", type=int, default=4, help="chat prompts of the accuracy check")
    p.add_argument("--accuracy-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    p.add_argument("--logit-tolerance", type=float, default=2.0,
                   help="ours may err at most this many times transformers' bf16 error (default %(default)s)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request in the throughput runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="our engine's per-step token budget")
    p.add_argument("--kv-gib", type=int, default=4, help="our KV pool, GiB (default %(default)s)")
    p.add_argument("--max-gib", type=float, default=40.0, help="GPU memory cap of this process, GiB")
    p.add_argument("--vllm-gpu-fraction", type=float, default=0.25,
                   help="vLLM's gpu_memory_utilization, beside our capped share (default %(default)s)")
    p.add_argument("--vllm-timeout-s", type=float, default=300.0)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args(argv)
    if args.kv_gib >= args.max_gib:
        p.error("--kv-gib must leave room under --max-gib for the weights of two models")
    if min(args.batch_sizes) < 1 or args.max_tokens < 2 or args.repeats < 1 or args.prompts < 1:
        p.error("batch sizes and --prompts must be positive, --max-tokens at least 2, --repeats at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # NOTE: a cap on torch's caching allocator: an allocation past it raises
    # OutOfMemoryError instead of taking a shared GPU's memory.
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.max_gib * 2**30 / total), CUDA)
    print("command:", shlex.join(sys.orig_argv))
    print(f"{torch.cuda.get_device_name(CUDA)} ({total / 2**30:.0f} GiB, capped at {args.max_gib:.0f} GiB); "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}; "
          f"load average {load_average()}")
    ok = True
    if not args.skip_accuracy:
        ok = check_accuracy(args)
    if not args.skip_throughput:
        check_throughput(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
