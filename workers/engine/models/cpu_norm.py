"""RMSNorm of float32 or bfloat16 rows on a CPU in one C call (csrc/rms_norm.c, see cpu_kernels).

PyTorch's float32 rms_norm dispatches seven ops; on a decode step's few rows
their dispatch is the cost (about 60 us a call, 61 calls a step for a 30-layer
model). The kernel computes what the reference models do, with the sum of
squares in vector lanes; in bfloat16 it rounds where they round.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from disagg.workers.engine import cpu_kernels

PROFILE_LABEL = "disagg::rms_norm_cpu"
_ARGTYPES: list[type] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int]


@functools.cache
def _kernel(dtype: torch.dtype) -> cpu_kernels.Kernel | None:
    return cpu_kernels.function(f"rms_norm_{cpu_kernels.DTYPE_SUFFIXES[dtype]}", _ARGTYPES, restype=None)


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm takes these tensors: float32 or bfloat16 on a CPU, the kernels built."""
    return x.dtype == weight.dtype and x.dtype in cpu_kernels.DTYPE_SUFFIXES and x.device.type == "cpu" \
        and _kernel(x.dtype) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> x / sqrt(mean(x^2) + eps) * weight, a new tensor."""
    kernel = _kernel(x.dtype)
    assert kernel is not None, "rms_norm needs serves() first"
    rows = x.contiguous()
    out = torch.empty_like(rows)
    weight = weight.contiguous()
    with cpu_kernels.profiled(PROFILE_LABEL):
        kernel(rows.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), rows.numel() // x.shape[-1], x.shape[-1],
               torch.get_num_threads())
    return out
