"""float32 projections on a CPU from weights packed in panels (csrc/panel_linear.c).

A weight [N, K] is packed once into panels of 16 output columns, each stored
k-major ([ceil(N / 16), K, 16], zero past N), so the kernel streams a panel in
the order its registers consume it while a tile of 6 rows of x stays in
registers. On the AVX2 AMD EPYC of docs/benchmarks-engine.md this ran 1.2x to
1.7x faster than oneDNN's packed float32 linear from 1 to 32 rows and 1.0x to
1.2x at 256 and 2048 (benchmarks/bench_linear.py); the results differ from it
only in summation order. Where the CPU has AVX-512, oneDNN runs 16 lanes where
this kernel runs 8, so oneDNN keeps those (not measured here: no such CPU), and
CPUs without AVX2 and FMA too (the kernel would run scalar);
DISAGG_CPU_LINEAR overrides the choice.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.config import cpu_flags

PANEL = 16  # output columns per panel, as panel_linear.c's
PROFILE_LABEL = "disagg::panel_linear_cpu"
SWITCH_ENV = "DISAGG_CPU_LINEAR"  # "panels" or "onednn": who serves float32 projections; unset: by the CPU
_ARGTYPES: list[type] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]


@functools.cache
def _kernel() -> cpu_kernels.Kernel | None:
    return cpu_kernels.function("panel_linear_f32", _ARGTYPES, restype=None)


def cpu_suits_panels(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """AVX2 with FMA (the kernel's vectors; without them it runs scalar loops) and no
    AVX-512 (where oneDNN runs twice the lanes)."""
    flags = cpu_flags(cpuinfo)
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


@functools.cache
def preferred() -> bool:
    """Whether float32 projections take the panel kernel here (see the module's docstring)."""
    choice = os.environ.get(SWITCH_ENV, "")
    if choice not in ("", "panels", "onednn"):
        raise ValueError(f"{SWITCH_ENV} must be 'panels' or 'onednn', got {choice!r}")
    if _kernel() is None or choice == "onednn":
        return False
    return choice == "panels" or cpu_suits_panels()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N / 16), K, 16], zero past N."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] float32: x @ W.T + bias, W packed by `pack`."""
    kernel = _kernel()
    assert kernel is not None, "panel_linear needs preferred() first"
    k = panels.shape[1]
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    with cpu_kernels.profiled(PROFILE_LABEL):
        kernel(rows.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
               rows.shape[0], out_features, k, torch.get_num_threads())
    return out.reshape(*x.shape[:-1], out_features)
