"""Elementwise steps of the layer body fused into one C pass each on a CPU
(csrc/silu_mul.c, csrc/rope.c; see cpu_kernels): the gated MLP's
silu(gate) * up, and RoPE rotating q and k in place, in float32 or bfloat16
(rounded where PyTorch's bfloat16 ops round).

PyTorch runs each as several ops, each a pass over memory and a new tensor:
on a float32 prefill step of 2048 tokens (SmolLM2-135M, 2 threads) they took
about 0.4 s of 3.4 (SiLU, the products, RoPE's swapped copy and sum); the two
kernels take 0.09 s (docs/benchmarks-engine.md).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from disagg.workers.engine import cpu_kernels

PROFILE_LABEL = "disagg::fused_elementwise_cpu"
_SILU_MUL_ARGS: list[type] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_ROPE_ARGS: list[type] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long, ctypes.c_int]


@functools.cache
def silu_mul_kernel(dtype: torch.dtype) -> cpu_kernels.Kernel | None:
    """The C function for `dtype` (None: the kernels are not built here), for callers that time it."""
    return cpu_kernels.function(f"silu_mul_{cpu_kernels.DTYPE_SUFFIXES[dtype]}", _SILU_MUL_ARGS, restype=None)


@functools.cache
def _rope(dtype: torch.dtype) -> cpu_kernels.Kernel | None:
    return cpu_kernels.function(f"rope_{cpu_kernels.DTYPE_SUFFIXES[dtype]}", _ROPE_ARGS, restype=None)


def _on_cpu_in_one_kernel_dtype(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in cpu_kernels.DTYPE_SUFFIXES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def serves_silu_mul(gate_up: torch.Tensor) -> bool:
    return _on_cpu_in_one_kernel_dtype(gate_up) and silu_mul_kernel(gate_up.dtype) is not None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] float32 or bfloat16 -> silu(gate) * up [..., I], a new tensor."""
    kernel = silu_mul_kernel(gate_up.dtype)
    assert kernel is not None, "silu_mul needs serves_silu_mul() first"
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width).contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype)
    with cpu_kernels.profiled(PROFILE_LABEL):
        kernel(rows.data_ptr(), out.data_ptr(), rows.shape[0], width, torch.get_num_threads())
    return out.reshape(*gate_up.shape[:-1], width)


def serves_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether rope_ can rotate x [T, heads, hd] in place: float32 or bfloat16 (all three
    alike) on a CPU, each token's heads contiguous (a view into the fused qkv rows is), cos
    and signed_sin [T, 1, hd] contiguous, the kernels built."""
    heads_contiguous = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    return _on_cpu_in_one_kernel_dtype(x, cos, signed_sin) and heads_contiguous and cos.is_contiguous() \
        and signed_sin.is_contiguous() and _rope(x.dtype) is not None


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, hd] in place (see layers.apply_rope); returns x."""
    kernel = _rope(x.dtype)
    assert kernel is not None, "rope_ needs serves_rope() first"
    tokens, heads, head_dim = x.shape
    with cpu_kernels.profiled(PROFILE_LABEL):
        kernel(x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), tokens, heads, head_dim, x.stride(0),
               torch.get_num_threads())
    return x
