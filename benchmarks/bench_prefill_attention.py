"""The CPU prefill attention kernel (csrc/prefill_attention.c) against PyTorch's SDPA
(a script, not a test).

One prompt's causal attention in a model shaped like the embedded default
(SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64), in `--dtype` (a bf16
prompt goes to the float32 kernel widened, its output rounded once), `--tokens`
new tokens after `--cached` cached ones, the queries, keys and values column
slices of one fused QKV row as the model hands them over. The two are timed in
turn, call by call, on the same tensors. Prints ms per call (one layer), the
causal half's GFLOP/s and the largest difference between the two outputs:

    .venv/bin/python benchmarks/bench_prefill_attention.py [--tokens 256 1024] [--cached 0] [--calls 30]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from bench_attention import median_ms

from disagg.workers.engine import cpu_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="new tokens of the prompt")
    p.add_argument("--cached", type=int, default=0, help="tokens cached before them (a prefix-cache hit)")
    p.add_argument("--calls", type=int, default=30, help="timed calls of each (default: 30)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    scale = HEAD_DIM ** -0.5
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {HEADS} heads over {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {args.cached} cached tokens, "
          f"{args.threads} threads; medians of {args.calls} calls in turn")
    print("| new tokens | kernel ms | SDPA ms | kernel GFLOP/s | SDPA GFLOP/s | speed-up | max abs difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        context = args.cached + tokens
        fused = torch.randn(context, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        q = fused[args.cached:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        keys = fused[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(context, KV_HEADS, HEAD_DIM)
        values = fused[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(context, KV_HEADS, HEAD_DIM)
        if not cpu_attention.supports_prefill(q, keys):
            print("the kernel does not run here (it needs AVX2, FMA and a C compiler)")
            return 1
        mask = torch.arange(context)[None, :] <= torch.arange(args.cached, context)[:, None]
        kernel_out = torch.empty(tokens, HEADS, HEAD_DIM, dtype=dtype)
        sdpa_out: list[torch.Tensor] = []

        def kernel() -> None:
            cpu_attention.prefill_attention(q, keys, values, kernel_out, scale)

        def sdpa() -> None:
            # as attention.paged_attention calls it
            sdpa_out[:] = [F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=None if args.cached == 0 else mask, is_causal=args.cached == 0, scale=scale,
                enable_gqa=True)[0].transpose(0, 1)]

        ms = median_ms({"kernel": kernel, "sdpa": sdpa}, args.calls)
        # scores and P V over the keys each query sees: 2 x 2 x head_dim flops per (query, key, head)
        pairs = sum(args.cached + i + 1 for i in range(tokens))
        gflop = 4 * HEAD_DIM * HEADS * pairs / 1e9
        difference = (kernel_out.float() - sdpa_out[0].float()).abs().max().item()
        print(f"| {tokens} | {ms['kernel']:.3f} | {ms['sdpa']:.3f} | {gflop / ms['kernel'] * 1e3:.1f} | "
              f"{gflop / ms['sdpa'] * 1e3:.1f} | {ms['sdpa'] / ms['kernel']:.2f}x | {difference:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
