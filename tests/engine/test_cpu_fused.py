"""SiLU x up and RoPE in one C pass each (models/cpu_fused.py) against PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.workers.engine.models import cpu_fused
from disagg.workers.engine.models.layers import apply_rope

pytestmark = pytest.mark.skipif(not cpu_fused.serves_silu_mul(torch.ones(1, 2)),
                                reason="no C compiler to build the CPU kernels")


def torch_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


def angles(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(head_dim // 2) * 2 / head_dim)
    freqs = torch.arange(tokens, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 13), (64, 1536)])  # 64 x 1536: the threaded path
def test_silu_mul_equals_torch_within_a_few_ulp(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 6
    got = cpu_fused.silu_mul(gate_up)
    gate, up = gate_up.split(width, dim=-1)
    assert got.shape == (rows, width)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-30, rtol=5e-7)


def test_silu_mul_at_the_extremes() -> None:
    gate = torch.tensor([[0.0, -0.0, 1e-8, -1e-8, 30.0, -30.0, 80.0, -80.0, 100.0, -100.0, -1e4, 1e4]])
    got = cpu_fused.silu_mul(torch.cat([gate, torch.full_like(gate, 2.0)], -1))
    torch.testing.assert_close(got, F.silu(gate) * 2.0, atol=1e-30, rtol=5e-7)
    assert torch.isfinite(got).all()


def test_rope_in_place_is_torch_to_the_bit_on_a_view_of_the_fused_rows() -> None:
    tokens, heads, kv_heads, head_dim = 37, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cos, signed_sin = angles(tokens, head_dim)
    expected = torch_rope(qk, cos, signed_sin)
    assert cpu_fused.serves_rope(qk, cos, signed_sin)
    got = apply_rope(qk, cos, signed_sin)
    assert got.data_ptr() == qk.data_ptr()  # rotated in place
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_bf16_rope_in_place_is_torch_to_the_bit() -> None:
    """Each product and the sum rounded to bf16, as PyTorch's bf16 ops round them."""
    tokens, heads, head_dim = 300, 12, 64  # enough values for the threaded path
    x = (torch.randn(tokens, heads, head_dim) * 4).bfloat16()
    cos, signed_sin = (t.bfloat16() for t in angles(tokens, head_dim))
    expected = torch_rope(x, cos, signed_sin)
    assert cpu_fused.serves_rope(x, cos, signed_sin)
    assert torch.equal(apply_rope(x, cos, signed_sin), expected)


@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 13), (64, 1536)])
def test_bf16_silu_mul_rounds_as_torch_does(rows: int, width: int) -> None:
    """silu(gate) rounded to bf16, times up, rounded: torch's two bf16 ops. The exponential's
    last-bit error may move a value across a bf16 rounding boundary, one ulp, rarely."""
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 6).bfloat16()
    got = cpu_fused.silu_mul(gate_up)
    gate, up = gate_up.split(width, dim=-1)
    expected = F.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == (rows, width)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.0, rtol=2**-7)
    assert (got == expected).float().mean() > 0.999


def test_rope_leaves_other_dtypes_and_layouts_to_torch() -> None:
    cos, signed_sin = angles(5, 8)
    x = torch.randn(5, 3, 8)
    assert not cpu_fused.serves_rope(x.half(), cos.half(), signed_sin.half())
    assert not cpu_fused.serves_rope(x.bfloat16(), cos, signed_sin)  # mixed dtypes
    strided_heads = torch.randn(5, 3, 16)[..., ::2]
    assert not cpu_fused.serves_rope(strided_heads, cos, signed_sin)
    expected = torch_rope(strided_heads, cos, signed_sin)
    assert torch.equal(apply_rope(strided_heads, cos, signed_sin), expected)
