"""Projections on a CPU from weights packed in panels (csrc/panel_linear.c, csrc/panel_linear_bf16.c).

float32: a weight [N, K] is packed once into panels of 16 output columns, each
stored k-major ([ceil(N / 16), K, 16], zero past N), so the kernel streams a
panel in the order its registers consume it while a tile of 6 rows of x stays
in registers. On the AVX2 AMD EPYC of docs/benchmarks-engine.md this ran 1.2x
to 1.7x faster than oneDNN's packed float32 linear from 1 to 32 rows and 1.0x
to 1.2x at 256 and 2048 (benchmarks/bench_linear.py); the results differ from
it only in summation order. Where the CPU has AVX-512, oneDNN runs 16 lanes
where this kernel runs 8 and was faster from 8 rows up on an AMX Xeon, so
oneDNN keeps those, and CPUs without AVX2 and FMA too (the kernel would run
scalar).

bfloat16: oneDNN packs a bf16 weight into panels of output columns in VNNI
pairs of k ([ceil(N / P), K / 2, P, 2], the layout `pack` makes): P is 32
where the CPU has AMX, 64 on an AVX-512 BF16 CPU without it (a Zen 4). Our
bf16 kernels read that same copy for steps of up to BF16_MAX_ROWS rows (a
decode's batches), where oneDNN's linear streamed a step's weights at half
the memory's speed:
- AMX (where Linux lends it): 1.4x to 2.1x faster than oneDNN's linear from 1
  to 32 rows, 1.0x to 1.6x at 64 and 128 (but for the output projection);
  from 256 rows oneDNN is up to 1.25x faster;
- VDPBF16PS vectors, without AMX: 1.27x to 1.76x from 1 to 16 rows on a
  Zen 4, 1.07x to 1.2x at 24 to 128.
Larger steps (a prefill's) stay with oneDNN (docs/benchmarks-engine.md). One
copy serves both: `onednn_panels` checks, for each weight, that oneDNN's
bytes are exactly `pack`'s for a width our kernel reads, and else leaves the
weight to oneDNN alone.

DISAGG_CPU_LINEAR overrides the choice for both.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.config import cpu_flags

log = logging.getLogger(__name__)

PANEL = 16  # output columns per float32 panel, as panel_linear.c's
BF16_PANEL = 32  # output columns per bf16 panel that `pack` makes by default, as AMX reads them
BF16_K_CHUNK = 32  # AMX's k per tile: a bf16 weight's K must be a multiple of it
BF16_MAX_ROWS = 128  # steps of up to this many rows take the bf16 kernel, larger ones oneDNN
PROFILE_LABEL = "disagg::panel_linear_cpu"
SWITCH_ENV = "DISAGG_CPU_LINEAR"  # "panels" or "onednn": who serves projections; unset: by the CPU
_ARGTYPES: list[type] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_BF16_ARGTYPES = _ARGTYPES[:-1] + [ctypes.c_int, ctypes.c_int]  # (..., k, panel_cols, threads)


class Bf16Kernel(NamedTuple):
    """A bf16 panel kernel: its C function and the panel widths (output columns) it reads."""

    name: str
    widths: tuple[int, ...]


# AMX first: where Linux lends the tiles they beat the vectors (3x at 8 rows, csrc/panel_linear_bf16.c).
BF16_KERNELS = (Bf16Kernel("panel_linear_bf16", (BF16_PANEL,)), Bf16Kernel("panel_linear_bf16_vec", (64, 32)))


class OnednnPanels(NamedTuple):
    """Where oneDNN's packed copy of a bf16 weight lies, and the width of its panels."""

    address: int
    width: int


@functools.cache
def _kernel(dtype: torch.dtype) -> cpu_kernels.Kernel | None:
    """The kernel for `dtype`, or None where none can run here (bf16 needs AMX and Linux's
    leave to use it, or AVX-512 BF16)."""
    if dtype == torch.float32:
        return cpu_kernels.function("panel_linear_f32", _ARGTYPES, restype=None)
    chosen = bf16_kernel()
    return None if chosen is None else cpu_kernels.function(chosen.name, _BF16_ARGTYPES)


@functools.cache
def bf16_kernel() -> Bf16Kernel | None:
    """The first of BF16_KERNELS that runs here, or None."""
    return next((kernel for kernel in BF16_KERNELS
                 if cpu_kernels.available_function(kernel.name, _BF16_ARGTYPES) is not None), None)


def cpu_suits_panels(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """For float32: AVX2 with FMA (the kernel's vectors; without them it runs scalar loops) and no
    AVX-512 (where oneDNN runs twice the lanes)."""
    flags = cpu_flags(cpuinfo)
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


@functools.cache
def preferred(dtype: torch.dtype = torch.float32) -> bool:
    """Whether projections in `dtype` take the panel kernel here (see the module's docstring)."""
    choice = os.environ.get(SWITCH_ENV, "")
    if choice not in ("", "panels", "onednn"):
        raise ValueError(f"{SWITCH_ENV} must be 'panels' or 'onednn', got {choice!r}")
    if dtype not in cpu_kernels.DTYPE_SUFFIXES or choice == "onednn" or _kernel(dtype) is None:
        return False
    return choice == "panels" or dtype == torch.bfloat16 or cpu_suits_panels()


def pack(weight: torch.Tensor, bf16_width: int = BF16_PANEL) -> torch.Tensor:
    """weight [N, K] -> float32 panels [ceil(N / 16), K, 16], or bf16 ones [ceil(N / W), K / 2, W, 2]
    (W: `bf16_width`); zero past N."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % BF16_K_CHUNK:
        raise ValueError(f"bf16 panels need K a multiple of {BF16_K_CHUNK}, got a weight of {k} columns")
    panel = PANEL if weight.dtype == torch.float32 else bf16_width
    padded = torch.zeros(-(-n // panel) * panel, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    if weight.dtype == torch.float32:
        return padded.view(-1, panel, k).transpose(1, 2).contiguous()
    return padded.view(-1, panel, k // 2, 2).transpose(1, 2).contiguous()


def onednn_panels(weight: torch.Tensor, onednn_packed: torch.Tensor) -> OnednnPanels | None:
    """Where oneDNN's packed copy of a bf16 `weight` (torch.ops.mkldnn._reorder_linear_weight's) lies
    when its bytes are exactly `pack(weight, width)`'s for a width our bf16 kernel reads, so that
    panel_linear_at may read it; else None.

    Equal bytes make the results right whatever oneDNN meant by its layout; a
    oneDNN that blocks differently leaves the weight to oneDNN alone."""
    kernel = bf16_kernel()
    if weight.dtype != torch.bfloat16 or weight.shape[1] % BF16_K_CHUNK or not preferred(torch.bfloat16) \
            or kernel is None:
        return None
    address = int(torch.ops.mkldnn.data_ptr(onednn_packed))
    for width in kernel.widths:
        expected = pack(weight, width)
        size = expected.numel() * expected.element_size()
        if torch.ops.mkldnn._nbytes(onednn_packed) == size and \
                ctypes.string_at(address, size) == expected.view(torch.int16).numpy().tobytes():
            return OnednnPanels(address, width)
    _warn_layout_differs()
    return None


@functools.cache
def _warn_layout_differs() -> None:
    """Once: a oneDNN build (an upgrade, another CPU) that blocks bf16 weights otherwise slows small steps."""
    log.warning("oneDNN's packed bf16 weights are not in our panels' layout here: bf16 projections stay "
                "with oneDNN, whose small steps are slower (models/panels.py)")


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] in the panels' dtype: x @ W.T + bias, W packed by `pack`."""
    if panels.dtype == torch.float32:
        return _run(x, panels.data_ptr(), panels.dtype, out_features, panels.shape[1], bias)
    return panel_linear_at(x, OnednnPanels(panels.data_ptr(), panels.shape[2]), out_features, bias)


def panel_linear_at(x: torch.Tensor, panels: OnednnPanels, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N] bf16 from bf16 panels (from onednn_panels)."""
    return _run(x, panels.address, torch.bfloat16, out_features, x.shape[-1], bias, panels.width)


def _run(x: torch.Tensor, address: int, dtype: torch.dtype, out_features: int, k: int,
         bias: torch.Tensor | None, bf16_width: int | None = None) -> torch.Tensor:
    kernel = _kernel(dtype)
    assert kernel is not None, "panel_linear needs preferred() first"
    if x.dtype != dtype or (bias is not None and bias.dtype != dtype):
        raise ValueError(f"panel_linear: x {x.dtype} and bias against {dtype} panels")
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=dtype)
    width = () if bf16_width is None else (bf16_width,)
    with cpu_kernels.profiled(PROFILE_LABEL):
        failed = kernel(rows.data_ptr(), address, None if bias is None else bias.data_ptr(), out.data_ptr(),
                        rows.shape[0], out_features, k, *width, torch.get_num_threads())
    if failed:  # (the float32 kernel returns nothing)
        raise RuntimeError(f"{getattr(kernel, '__name__', 'panel_linear')} failed: {failed}")
    return out.reshape(*x.shape[:-1], out_features)
