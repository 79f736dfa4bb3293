"""Weights on a GGUF quantisation grid, served from their codes on a CPU (csrc/grid_linear.c).

A GGUF model's weights were quantised in groups of 32 along a row; the loader
dequantises them to float32. Two grids are recognised:

- Q4_1 (the embedded default's decoder layers): w = d * q + m, q in 0..15;
- Q8_0 (its embedding, tied to the output projection): w = d * q, q in -127..127;

d and m in fp16. `find_grid` finds the grid again in a float32 weight and
keeps it only when it reproduces every weight exactly, so a projection served
from the codes computes the same float32 matmul (up to summation order) from
a sixth or a quarter of the bytes. Decode steps of a few rows are bound by
reading the weights, so they take this path; steps of many rows (prefills)
are bound by arithmetic and keep oneDNN's packed float32 path (packing.py).
"""

from __future__ import annotations

import ctypes
import enum
import functools
from typing import NamedTuple

import torch

from disagg.workers.engine import cpu_kernels

GROUP = 32
PROFILE_LABEL = "disagg::grid_linear_cpu"
Q4_LEVELS = 15  # Q4_1: q in 0..Q4_LEVELS
Q8_LIMIT = 127  # Q8_0: q in -Q8_LIMIT..Q8_LIMIT
_ARGTYPES: list[type] = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]


class GridFormat(enum.IntEnum):  # the values are grid_linear.c's
    Q4_1 = 0
    Q8_0 = 1


class GridWeight(NamedTuple):
    format: GridFormat
    codes: torch.Tensor  # Q4_1: [N, K / 2] uint8, byte j of a group holds q[j] (low) and q[j + 16] (high); Q8_0: [N, K] int8
    scales: torch.Tensor  # Q4_1: [N, K / GROUP, 2] float32 (d, m); Q8_0: [N, K / GROUP] float32 (d)

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * (2 if self.format is GridFormat.Q4_1 else 1)


@functools.cache
def _kernel() -> cpu_kernels.Kernel | None:
    return cpu_kernels.function("grid_linear_f32", _ARGTYPES)


def is_available() -> bool:
    return _kernel() is not None


def _q4_1(groups: torch.Tensor) -> GridWeight | None:
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / Q4_LEVELS).half().float()
    m = low.half().float()
    q = ((groups - m) / torch.where(d > 0, d, 1.0)).round().clamp(0, Q4_LEVELS)
    if not torch.equal(d * q + m, groups):  # two float32 roundings, as the kernel computes it
        return None
    q = q.to(torch.uint8)
    codes = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)  # [N, K/32, 16]
    return GridWeight(GridFormat.Q4_1, codes.reshape(groups.shape[0], -1).contiguous(),
                      torch.cat([d, m], -1).contiguous())


def _q8_0(groups: torch.Tensor) -> GridWeight | None:
    d = (groups.abs().amax(-1, keepdim=True) / Q8_LIMIT).half().float()
    q = (groups / torch.where(d > 0, d, 1.0)).round().clamp(-Q8_LIMIT, Q8_LIMIT)
    if not torch.equal(d * q, groups):
        return None
    return GridWeight(GridFormat.Q8_0, q.to(torch.int8).reshape(groups.shape[0], -1).contiguous(),
                      d.reshape(groups.shape[0], -1).contiguous())


def find_grid(weight: torch.Tensor) -> GridWeight | None:
    """weight [N, K] float32 as the codes of the first grid (Q4_1, then Q8_0) that
    reproduces every weight exactly, or None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    with torch.no_grad():
        groups = weight.detach().reshape(weight.shape[0], -1, GROUP)  # [N, K/32, 32]
        return _q4_1(groups) or _q8_0(groups)


class SourceGrids:
    """The grids of a checkpoint's float32 tensors, found as they load into weights of another
    dtype (a bf16 model from a GGUF's dequantised float32). The cast rounds the weights; the
    codes keep them exact and serve small steps as they do in a float32 model (a sixth or a
    quarter of the bytes a step reads; a bf16 model's own weights are half)."""

    def __init__(self) -> None:
        self._shards: dict[str, list[tuple[int, GridWeight | None]]] = {}

    def offer(self, name: str, first_row: int, tensor: torch.Tensor) -> None:
        """A checkpoint tensor [rows, K] loaded into rows `first_row`.. of the weight `name`."""
        self._shards.setdefault(name, []).append((first_row, find_grid(tensor)))

    def found(self, rows_of: dict[str, int]) -> dict[str, GridWeight]:
        """The weights whose every row came from tensors on one grid, by name (`rows_of`: each
        weight's rows)."""
        out = {}
        for name, shards in self._shards.items():
            row, parts = 0, list[GridWeight]()
            for first, grid in sorted(shards, key=lambda shard: shard[0]):
                if grid is None or first != row or (parts and grid.format is not parts[0].format):
                    break
                parts.append(grid)
                row += grid.codes.shape[0]
            else:
                if row == rows_of[name]:
                    out[name] = GridWeight(parts[0].format, torch.cat([g.codes for g in parts]),
                                           torch.cat([g.scales for g in parts]))
        return out


def grid_linear(x: torch.Tensor, weight: GridWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: x @ W.T + bias, W dequantised in registers, the
    sums in float32 (`bias` float32); a bf16 x is widened first and the result rounded once."""
    kernel = _kernel()
    assert kernel is not None, "grid_linear needs is_available() first"
    n, k = weight.codes.shape[0], weight.in_features
    rows = x.reshape(-1, k).float().contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    with cpu_kernels.profiled(PROFILE_LABEL):
        status = kernel(int(weight.format), rows.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k,
                        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"grid_linear_f32 refused a weight of {k} columns (a multiple of {GROUP} is needed)")
    return out.reshape(*x.shape[:-1], n).to(x.dtype)
