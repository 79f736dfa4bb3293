"""Attention kernels for the CPU (see cpu_kernels): paged decode attention
(csrc/paged_decode.c) and, in float32 where the CPU has AVX2 and FMA, a
prompt's causal attention (csrc/prefill_attention.c; a bf16 prompt's widened
to float32: 1.9x SDPA's bf16 path at 256 tokens on a Zen 4, docs/benchmarks-engine.md).

The plain path (attention._decode) copies every decode sequence's context into
a padded tensor per layer and step, then runs SDPA over the copy: at 32
sequences of 384 tokens that is three passes over the cache. The kernel reads
each K and V row once, in place through the block tables, for all the query
heads that share it, with an online softmax (the CPU twin of
triton_attention).

A float32 prompt's attention ran in PyTorch's SDPA at about 40 GFLOP/s on two
AVX2 cores, an eighth of a prefill step; the prefill kernel computes the
scores, their softmax and P V of a few query rows at a time in registers and a
thread's own buffers (a flash attention), as vLLM's CPU backend has its own:
about 80 GFLOP/s there.

DISAGG_CPU_ATTENTION=gather keeps the plain paths: the padded gather for
decode rows, SDPA for prompts.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from disagg.workers.engine import cpu_kernels

SWITCH_ENV = "DISAGG_CPU_ATTENTION"  # "gather": never use the kernels
PROFILE_LABEL = "disagg::paged_decode_cpu"
PREFILL_PROFILE_LABEL = "disagg::prefill_attention_cpu"
# The kernel's stack buffers (csrc/paged_decode.c); other shapes take the gather path.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 32, 256, 256
PREFILL_HEAD_DIM_STEP = 16  # the prefill kernel's head_dim: a multiple of two 8-lane vectors, up to MAX_HEAD_DIM

INT32_P = ctypes.POINTER(ctypes.c_int32)
# paged_decode_{f32,bf16}'s C signature (benchmarks/bench_attention.py calls other builds of it too).
ARGTYPES: list[type] = [ctypes.c_void_p, ctypes.c_void_p, INT32_P, INT32_P, ctypes.c_void_p,
                         *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_int]

# prefill_attention_f32's C signature: q, k, v, out, q_len, kv_len, heads, kv_heads, head_dim,
# the three row strides (elements), scale, threads.
PREFILL_ARGTYPES: list[type] = [*[ctypes.c_void_p] * 4, *[ctypes.c_int] * 5, *[ctypes.c_long] * 3, ctypes.c_float,
                                 ctypes.c_int]


@functools.cache
def _kernels() -> dict[torch.dtype, cpu_kernels.Kernel] | None:
    if os.environ.get(SWITCH_ENV) == "gather":
        return None
    found = {dtype: cpu_kernels.function(f"paged_decode_{suffix}", ARGTYPES)
             for dtype, suffix in cpu_kernels.DTYPE_SUFFIXES.items()}
    return {dtype: kernel for dtype, kernel in found.items() if kernel is not None} or None


def is_available() -> bool:
    """Whether the kernel is built (or can be) on this machine and not switched off."""
    return _kernels() is not None


def supports(cache: torch.Tensor, num_heads: int) -> bool:
    """Whether the kernel serves attention of `num_heads` query heads over `cache`, a
    layer's [num_blocks, 2, block_size, kvh, hd] or the whole model's (a layer dimension first)."""
    block_size, num_kv_heads, head_dim = cache.shape[-3:]
    shapes_fit = num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP \
        and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK
    return cache.device.type == "cpu" and cache.dtype in cpu_kernels.DTYPE_SUFFIXES and shapes_fit and is_available()


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, heads, hd]; layer_cache: [num_blocks, 2, block_size, kvh, hd] (contiguous);
    block_tables: [B, max_blocks] int32; context_lens: [B] int32. Returns [B, heads, hd] in q's dtype."""
    kernels = _kernels()
    assert kernels is not None, "paged_decode_attention needs supports() first"
    assert layer_cache.is_contiguous(), "the kernel reads the cache in place"
    batch, heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = layer_cache.shape
    query = q.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    with cpu_kernels.profiled(PROFILE_LABEL):
        status = kernels[layer_cache.dtype](
            query.data_ptr(), layer_cache.data_ptr(), ctypes.cast(tables.data_ptr(), INT32_P),
            ctypes.cast(lens.data_ptr(), INT32_P), out.data_ptr(), batch, heads, kv_heads, head_dim, block_size,
            tables.shape[1], scale, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"paged decode kernel refused its arguments (code {status}): heads {heads}, "
                         f"kv heads {kv_heads}, head dim {head_dim}, block size {block_size}")
    return out.to(q.dtype)


@functools.cache
def _prefill_kernels() -> dict[torch.dtype, cpu_kernels.Kernel]:
    if os.environ.get(SWITCH_ENV) == "gather":
        return {}
    found = {torch.float32: cpu_kernels.available_function("prefill_attention_f32", PREFILL_ARGTYPES)}
    return {dtype: kernel for dtype, kernel in found.items() if kernel is not None}


def supports_prefill(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether prefill_attention serves these queries ([q_len, heads, hd]) over these keys ([ctx, kvh, hd])."""
    head_dim, kv_heads = q.shape[-1], keys.shape[-2]
    shapes_fit = head_dim % PREFILL_HEAD_DIM_STEP == 0 and head_dim <= MAX_HEAD_DIM and q.shape[-2] % kv_heads == 0
    return q.device.type == "cpu" and q.dtype == keys.dtype and _prefill_kernel(q.dtype) is not None and shapes_fit


def _prefill_kernel(dtype: torch.dtype) -> cpu_kernels.Kernel | None:
    # A bf16 prompt runs the float32 kernel on widened copies (exact: every bf16 is a float32), its
    # output rounded once; SDPA's bf16 path also rounds the probabilities.
    return _prefill_kernels().get(torch.float32 if dtype == torch.bfloat16 else dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # the kernel takes tokens any stride apart, each token's heads packed
    head_dim = x.shape[-1]
    return x if x.stride(-1) == 1 and x.stride(-2) == head_dim else x.contiguous()


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                      scale: float) -> None:
    """Causal attention of one prompt's new tokens into `out` (supports_prefill first).

    q, out: [q_len, heads, hd]; keys, values: [ctx, kvh, hd] with ctx >= q_len, the
    queries being the last q_len positions (a cached prefix before them)."""
    kernel = _prefill_kernel(q.dtype)
    assert kernel is not None, "prefill_attention needs supports_prefill() first"
    if q.dtype == torch.bfloat16:
        wide = torch.empty(out.shape, dtype=torch.float32)
        prefill_attention(q.float(), keys.float(), values.float(), wide, scale)
        out.copy_(wide)
        return
    assert out.stride(-1) == 1 and out.stride(-2) == out.shape[-1], "the kernel writes each token's heads packed"
    q, keys, values = _rows(q), _rows(keys), _rows(values)
    if keys.stride(0) != values.stride(0):  # the kernel takes one stride for both
        keys, values = keys.contiguous(), values.contiguous()
    (q_len, heads, head_dim), (ctx, kv_heads, _) = q.shape, keys.shape
    with cpu_kernels.profiled(PREFILL_PROFILE_LABEL):
        status = kernel(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), q_len, ctx, heads, kv_heads,
                        head_dim, q.stride(0), keys.stride(0), out.stride(0), scale, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"prefill attention kernel refused its arguments (code {status}): {q_len} queries over "
                         f"{ctx} keys, heads {heads}, kv heads {kv_heads}, head dim {head_dim}, scale {scale}")
