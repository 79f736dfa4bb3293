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


def test_the_module_takes_the_kernel_in_float32_only() -> None:
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64))
    x = torch.randn(4, 64)
    assert cpu_norm.serves(x, norm.weight)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))
    assert not cpu_norm.serves(x.bfloat16(), norm.weight.bfloat16())
    bf16 = norm.to(torch.bfloat16)
    assert bf16(x.bfloat16()).dtype == torch.bfloat16
