"""Linear weights pre-packed for the CPU's fast matmuls.

Most of a CPU step is matmuls against every weight. Run from a weight
reordered once into a blocked layout, they are 1.8x to 2.6x faster than BLAS
runs them from a strided one (fp32, batch 1 to 32; measured in
docs/benchmarks-engine.md), because the kernel then streams the weight in the
order its registers consume it. Two packers serve: float32 weights go to our
panel kernel where it is preferred (models/panels.py: faster than oneDNN on
AVX2 CPUs), everything else to oneDNN's layout, which for bf16 on AMX and
AVX-512 BF16 CPUs our bf16 kernels read too, for small steps. The results are the same
matmul up to fp32 rounding order. Packing is for inference only: the packed
tensor is opaque, so nothing may load weights into a packed model afterwards.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from disagg.workers.engine.models import grids, panels

# Steps of at most this many rows (by grid and the model's dtype) read a weight on a
# quantisation grid from its codes (models/grids.py); bigger ones are bound by arithmetic,
# where the dtype's own path is faster. benchmarks/bench_grid_rows.py measures where: float32
# against our panels, bf16 against oneDNN's bf16 linear (docs/benchmarks-engine.md, "Grid codes
# for bf16 models"); where our bf16 kernels serve, they are not used (PackedLinear).
GRID_MAX_ROWS = {
    (grids.GridFormat.Q4_1, torch.float32): 8, (grids.GridFormat.Q8_0, torch.float32): 8,
    (grids.GridFormat.Q4_1, torch.bfloat16): 4, (grids.GridFormat.Q8_0, torch.bfloat16): 2,
}
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """True when this torch build has oneDNN's linear ops and they run here in `dtype`
    (bf16 needs CPU support that older oneDNN versions refuse without)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=dtype), None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=dtype), packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out.float(), torch.full((1, 2), 2.0)))


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pack_linear_weights can serve a model in `dtype` on `device`."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES:
        return False
    return (dtype == torch.float32 and panels.preferred()) or _onednn_works(dtype)


def codes_may_serve(dtype: torch.dtype) -> bool:
    """Whether small steps of a packed model in `dtype` may read a weight's grid codes here: not
    where our bf16 kernels serve them (PackedLinear), so that a loader need not look for codes."""
    return grids.is_available() and not (dtype == torch.bfloat16 and panels.preferred(dtype))


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias, with the weight held in panels (float32, where
    panels.preferred()) or in oneDNN's blocked layout (which our bf16 kernel
    reads for small steps, where panels.onednn_panels finds our panels in it),
    and as codes too when it sits exactly on a quantisation grid (models/grids.py)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None
    grid_bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, grid: grids.GridWeight | None = None) -> None:
        """`grid`: the weight's codes when they were found before it was cast (SourceGrids);
        else a float32 weight is looked at here."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.in_panels = weight.dtype == torch.float32 and panels.preferred()
        with torch.no_grad():
            # batch_size=None: one oneDNN layout for every row count (a hint of 1 slows batches down 2x).
            packed = panels.pack(weight) if self.in_panels else \
                torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.onednn_panels = None if self.in_panels else panels.onednn_panels(weight, packed)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)
        if grid is None and grids.is_available():
            grid = grids.find_grid(weight)
        assert grid is None or (grid.codes.shape[0], grid.in_features) == tuple(weight.shape), "the weight's own codes"
        # Where our bf16 kernels serve small steps, they beat the codes too (decode steps of 1 to 4
        # rows on a Zen 4: 9.3-10.3 ms of projections against 10.9-14.4; docs/benchmarks-engine.md).
        self.grid = None if self.onednn_panels is not None else grid
        # The codes' kernel sums in float32, and adds a float32 bias (the same tensor for a float32 model).
        self.register_buffer("grid_bias", None if bias is None or self.grid is None else bias.detach().float().contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid is not None and x.shape[0] <= GRID_MAX_ROWS[self.grid.format, x.dtype]:
            return grids.grid_linear(x, self.grid, self.grid_bias)
        if self.in_panels:
            return panels.panel_linear(x, self.packed_weight, self.out_features, self.bias)
        if self.onednn_panels is not None and x.numel() <= panels.BF16_MAX_ROWS * self.in_features:
            return panels.panel_linear_at(x, self.onednn_panels, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={'panels' if self.in_panels else 'onednn'}"
                f"{', small steps by the bf16 kernel' if self.onednn_panels is not None else ''}, "
                f"grid={self.grid.format.name if self.grid else None}")


def pack_linear_weights(model: nn.Module, source_grids: dict[str, grids.GridWeight] | None = None) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear; returns how many were replaced.
    `source_grids`: codes found at load time, by weight name (grids.SourceGrids).

    The replaced weights are released; call it once the weights are loaded.
    """
    replaced = 0
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                grid = (source_grids or {}).get(f"{path}.{name}.weight" if path else f"{name}.weight")
                setattr(parent, name, PackedLinear(child.weight, child.bias, grid))
                replaced += 1
    return replaced
