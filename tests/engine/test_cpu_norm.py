"""RMSNorm in one C call (models/cpu_norm.py, csrc/rms_norm.c) against PyTorch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.workers.engine.models import cpu_norm
from disagg.workers.engine.models.layers import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_norm.serves(torch.ones(1), torch.ones(1)),
                                reason="no C compiler to build the CPU kernels")


@pytest.mark.parametrize("shape", [(1, 576), (3, 7), (5, 4, 64), (100, 96), (2, 17)])  # 100 rows: the threaded path
def test_rms_norm_equals_torch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    got = cpu_norm.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.data_ptr() != x.data_ptr()
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), weight, 1e-5), atol=1e-6, rtol=1e-6)


def test_a_strided_input_is_read_by_value() -> None:
    x = torch.randn(8, 64)
    weight = torch.rand(32)
    half = x[:, 16:48]  # not contiguous
    torch.testing.assert_close(cpu_norm.rms_norm(half, weight, 1e-6), F.rms_norm(half, (32,), weight, 1e-6))


@pytest.mark.parametrize("rows", [1, 100])
def test_bf16_rounds_where_the_reference_models_round(rows: int) -> None:
    """The reference models' bf16 RMSNorm: float32 math, x * inverse rounded to bf16, then the
    bf16 product with the weight. Equal but for the sum of squares' order, which may move a
    value across a bf16 rounding boundary (one ulp), rarely."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    wide = x.float()
    expected = weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    got = cpu_norm.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=0.0, rtol=2**-7)
    assert (got == expected).float().mean() > 0.999


def test_the_module_takes_the_kernel_in_float32_and_bf16() -> None:
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64))
    x = torch.randn(4, 64)
    assert cpu_norm.serves(x, norm.weight)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))
    assert cpu_norm.serves(x.bfloat16(), norm.weight.bfloat16())
    assert not cpu_norm.serves(x.half(), norm.weight.half())
    half = norm.to(torch.float16)
    assert half(x.half()).dtype == torch.float16
