"""Building blocks shared by the model families: norm, rotary embedding, MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from disagg.workers.engine.model_config import ACTIVATIONS, ModelConfig, RopeScaling
from disagg.workers.engine.models import cpu_fused, cpu_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 and bf16 the kernel equals the reference models up to the summation
        # order; in fp16 F.rms_norm accumulates in fp32 and may differ by the last rounding.
        if cpu_norm.serves(x, self.weight):
            return cpu_norm.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin computed from each token's position."""

    inv_freq: torch.Tensor  # [hd/2] fp32

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        # NOTE: a non-persistent buffer; after building on the meta device, call
        # reset_inv_freq() (CausalLM.create does) so it holds real fp32 values.
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)

    def reset_inv_freq(self) -> None:
        half = self.head_dim // 2
        exponents = torch.arange(0, half, dtype=torch.float32, device=self.inv_freq.device) * 2 / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, self.scaling)
        self.inv_freq = inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, signed_sin), each [T, 1, hd] in `dtype`, for apply_rope.

        The angles are computed in fp32 and rounded once, as the reference models do.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; rotates each pair (i, i + hd/2) by its position's angle:
    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] = x * cos + [x2, x1] * [-sin, sin].

    NOTE: on a CPU in float32 or bfloat16 the rotation is done in place (cpu_fused.rope_),
    so x's values are lost; the result is returned either way."""
    if cpu_fused.serves_rope(x, cos, signed_sin):
        return cpu_fused.rope_(x, cos, signed_sin)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * signed_sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.rope_type == "llama3", f"unknown rope type {scaling.rope_type}"
    # Llama 3.1: wavelengths longer than the original context / low_freq_factor are
    # stretched by `factor`, shorter than context / high_freq_factor kept, and the
    # band between blends the two linearly in (context / wavelength).
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    blend = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    in_band = (wavelen >= context / scaling.high_freq_factor) & (wavelen <= context / scaling.low_freq_factor)
    return torch.where(in_band, blended, stretched)


def input_major(rows: int, cols: int) -> nn.Parameter:
    """A [rows, cols] parameter stored as the transpose of a contiguous [cols, rows].

    NOTE: for weights used as `x @ weight.T` (linear layers, the output
    projection): with this layout CPU matmuls of a few rows (decode batches) run
    up to 2x faster, as the BLAS kernel reads the weight in its natural order.
    Strides survive .to() and .to_empty(), and loading by rows still works.
    """
    return nn.Parameter(torch.empty(cols, rows).t())


class Linear(nn.Linear):
    """nn.Linear with an input-major weight (see input_major); same math and names."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.weight = input_major(out_features, in_features)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; act is
    config.hidden_act (SiLU for most families)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = ACTIVATIONS[config.hidden_act]
        self.act_is_silu = config.hidden_act == "silu"
        # weight rows: [gate (intermediate) | up (intermediate)]
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_is_silu and cpu_fused.serves_silu_mul(gate_up):
            return self.down_proj(cpu_fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
