"""How far greedy tokens in bf16 follow fp32: ours and transformers' (a script, not a test).

bf16 flips near-ties between the top two logits, so a bf16 engine's greedy
text drifts from fp32's sooner or later; what matters is whether ours drifts
more than transformers' bf16 does on the same CPU. One run, the same chat
prompts, `--max-tokens` new tokens each (greedy; ours with `ignore_eos`,
transformers with `min_new_tokens`), against our fp32 engine's tokens:

- transformers fp32 (a check that both run the same model),
- transformers bf16,
- ours bf16 from oneDNN-packed weights (the CPU default) and from plain ones.

For each, up to the first end-of-sequence token of ours in fp32: how many
answers are identical, and the mean share of each answer they have in common. Prints this CPU's bf16 flags too: the packed path uses AMX where the
CPU has it.

    .venv/bin/python benchmarks/agree_dtypes.py [--prompts 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch
from bench_engine import chat_prompts
from transformers import AutoModelForCausalLM

from disagg.workers.engine.config import NATIVE_BF16_FLAGS, EngineConfig, cpu_flags
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import default_cache_dir, load_model, resolve_model_dir
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.tokenizer import Tokenizer

Answers = list[list[int]]


def ours(model: str, prompts: Answers, max_tokens: int, dtype: torch.dtype, packed: bool) -> Answers:
    blocks = len(prompts) * -(-(max(map(len, prompts)) + max_tokens) // 16)
    config = EngineConfig(model=model, device="cpu", dtype=str(dtype).removeprefix("torch."), num_kv_blocks=blocks,
                          max_num_seqs=len(prompts), pack_cpu_weights=packed)
    engine = LLMEngine(config, load_model(model, dtype, torch.device("cpu")),
                       Tokenizer.from_dir(resolve_model_dir(model, default_cache_dir())))
    answers: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        answers[str(i)] = []
    while engine.has_unfinished_requests:
        for output in engine.step():
            answers[output.request_id] += output.new_token_ids
    return [answers[str(i)] for i in range(len(prompts))]


@torch.no_grad()
def transformers_answers(model_dir: str, prompts: Answers, max_tokens: int, dtype: torch.dtype) -> Answers:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    for prompt in prompts:  # one at a time: no padding in the way
        tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def agreement(answers: Answers, reference: Answers, eos: frozenset[int]) -> str:
    """Answers compared up to the reference's first end-of-sequence token: past it, both run on
    text the model was never trained to continue."""
    def until_eos(tokens: list[int]) -> list[int]:
        return tokens[:next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    cut = [(a[:len(until_eos(r))], until_eos(r)) for a, r in zip(answers, reference)]
    same = sum(a == r for a, r in cut)
    prefix = statistics.mean(common(a, r) / len(r) for a, r in cut)
    return f"{same}/{len(reference)} identical, {prefix:.0%} of each answer in common on average"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--prompts", type=int, default=16, help="chat prompts (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (default %(default)s)")
    args = p.parse_args(argv)
    model_dir = resolve_model_dir(args.model, default_cache_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = chat_prompts(tokenizer, args.prompts)
    print(f"{args.model}: {len(prompts)} chat prompts, {args.max_tokens} greedy tokens each; "
          f"bf16 flags of this CPU: {sorted(NATIVE_BF16_FLAGS & cpu_flags()) or 'none'}")
    reference = ours(args.model, prompts, args.max_tokens, torch.float32, packed=True)
    runs = {
        "transformers fp32": lambda: transformers_answers(str(model_dir), prompts, args.max_tokens, torch.float32),
        "transformers bf16": lambda: transformers_answers(str(model_dir), prompts, args.max_tokens, torch.bfloat16),
        "ours bf16, packed (the default)": lambda: ours(args.model, prompts, args.max_tokens, torch.bfloat16, True),
        "ours bf16, plain weights": lambda: ours(args.model, prompts, args.max_tokens, torch.bfloat16, False),
    }
    for name, run in runs.items():
        print(f"  {name:32s} vs ours fp32: {agreement(run(), reference, frozenset(tokenizer.eos_token_ids))}",
              flush=True)


if __name__ == "__main__":
    main()
