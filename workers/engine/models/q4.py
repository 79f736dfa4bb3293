"""Weights on a 4-bit grid, served from their codes on a CPU (csrc/q4_linear.c).

A GGUF model quantised as Q4_1 (the embedded default is) has every group of 32
weights along a row equal to d * q + m, q in 0..15, d and m in fp16; the loader
dequantises them to fp32. `q4_grid` finds that grid again in a float32 weight
and keeps it only when it reproduces every weight exactly, so a projection
served from the codes computes the same float32 matmul (up to summation order)
from a sixth of the bytes. Decode steps of a few rows are bound by reading the
weights, so they take this path; steps of many rows (prefills) are bound by
arithmetic and keep oneDNN's packed float32 path (packing.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from disagg.workers.engine import cpu_kernels

GROUP = 32
PROFILE_LABEL = "disagg::q4_linear_cpu"
LEVELS = 15  # q in 0..LEVELS
_ARGTYPES: list[type] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]


class Q4Weight(NamedTuple):
    codes: torch.Tensor  # [N, K / 2] uint8: byte j of a group holds q[j] (low nibble) and q[j + 16] (high)
    scales: torch.Tensor  # [N, K / GROUP, 2] float32: (d, m) of each group


@functools.cache
def _kernel() -> cpu_kernels.Kernel | None:
    return cpu_kernels.function("q4_linear_f32", _ARGTYPES)


def is_available() -> bool:
    return _kernel() is not None


def q4_grid(weight: torch.Tensor) -> Q4Weight | None:
    """weight [N, K] float32 as 4-bit codes, or None unless every weight is exactly d * q + m
    of its group's fp16 d and m (two float32 roundings, as the kernel computes it)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    with torch.no_grad():
        groups = weight.detach().reshape(weight.shape[0], -1, GROUP)  # [N, K/32, 32]
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        d = ((high - low) / LEVELS).half().float()
        m = low.half().float()
        q = ((groups - m) / torch.where(d > 0, d, 1.0)).round().clamp(0, LEVELS)
        if not torch.equal(d * q + m, groups):
            return None
        q = q.to(torch.uint8)
        codes = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)  # [N, K/32, 16]
        return Q4Weight(codes.reshape(weight.shape[0], -1).contiguous(), torch.cat([d, m], -1).contiguous())


def q4_linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] float32: x @ W.T + bias, W dequantised in registers."""
    kernel = _kernel()
    assert kernel is not None, "q4_linear needs is_available() first"
    n, k = weight.codes.shape[0], weight.codes.shape[1] * 2
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    with torch.profiler.record_function(PROFILE_LABEL):  # named in profiles (benchmarks/profile_step.py)
        status = kernel(rows.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k,
                        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"q4_linear_f32 refused a weight of {k} columns (a multiple of {GROUP} is needed)")
    return out.reshape(*x.shape[:-1], n)
