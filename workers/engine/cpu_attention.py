"""Paged decode attention on the CPU: csrc/paged_decode.c (see cpu_kernels).

The plain path (attention._decode) copies every decode sequence's context into
a padded tensor per layer and step, then runs SDPA over the copy: at 32
sequences of 384 tokens that is three passes over the cache. The kernel reads
each K and V row once, in place through the block tables, for all the query
heads that share it, with an online softmax (the CPU twin of
triton_attention). DISAGG_CPU_ATTENTION=gather keeps the plain path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from disagg.workers.engine import cpu_kernels

SWITCH_ENV = "DISAGG_CPU_ATTENTION"  # "gather": never use the kernel
PROFILE_LABEL = "disagg::paged_decode_cpu"
# The kernel's stack buffers (csrc/paged_decode.c); other shapes take the gather path.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 32, 256, 256

INT32_P = ctypes.POINTER(ctypes.c_int32)
# paged_decode_{f32,bf16}'s C signature (benchmarks/bench_attention.py calls other builds of it too).
ARGTYPES: list[type] = [ctypes.c_void_p, ctypes.c_void_p, INT32_P, INT32_P, ctypes.c_void_p,
                         *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_int]


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
