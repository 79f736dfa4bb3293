"""float32 projections from panel-packed weights (models/panels.py, csrc/panel_linear.c) against F.linear."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.models import panels
from disagg.workers.engine.models.packing import PackedLinear, packing_available

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler to build the CPU kernels")


@pytest.fixture
def choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """DISAGG_CPU_LINEAR set by the test, read afresh by panels.preferred()."""
    panels.preferred.cache_clear()
    yield monkeypatch
    monkeypatch.delenv(panels.SWITCH_ENV, raising=False)
    panels.preferred.cache_clear()


# rows: every tile tail (1 to 5 rows past a tile of 6), and 200 (two blocks of rows);
# (n, k): a partial last panel (40, 17) and odd k (33, 5).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 11, 200])
@pytest.mark.parametrize("n, k", [(48, 40), (40, 33), (17, 5), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_f_linear(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    got = panels.panel_linear(x, panels.pack(weight), n, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5 * k ** 0.5, rtol=1e-5)


def test_leading_dimensions_and_strided_input_are_kept() -> None:
    weight = torch.randn(24, 32)
    x = torch.randn(2, 3, 64)[..., ::2]  # [2, 3, 32], not contiguous
    got = panels.panel_linear(x, panels.pack(weight), 24, None)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_pack_pads_the_last_panel_with_zeros() -> None:
    weight = torch.randn(20, 7)
    packed = panels.pack(weight)
    assert packed.shape == (2, 7, panels.PANEL) and packed.is_contiguous()
    torch.testing.assert_close(packed[0], weight[:16].t())
    torch.testing.assert_close(packed[1, :, :4], weight[16:].t())
    assert not packed[1, :, 4:].any()


def test_packed_linear_takes_panels_in_float32_only(choice: pytest.MonkeyPatch) -> None:
    choice.setenv(panels.SWITCH_ENV, "panels")
    weight, bias = torch.randn(48, 40), torch.randn(48)
    layer = PackedLinear(weight, bias)
    assert layer.in_panels and "layout=panels" in repr(layer)
    x = torch.randn(9, 40)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    if packing_available(torch.device("cpu"), torch.bfloat16):  # else oneDNN refuses bf16 on this CPU
        assert not PackedLinear(weight.bfloat16(), None).in_panels


def test_the_switch_chooses_and_rejects_what_it_does_not_know(choice: pytest.MonkeyPatch) -> None:
    choice.setenv(panels.SWITCH_ENV, "onednn")
    assert not panels.preferred()
    assert not PackedLinear(torch.randn(16, 8), None).in_panels
    panels.preferred.cache_clear()
    choice.setenv(panels.SWITCH_ENV, "panels")
    assert panels.preferred()
    panels.preferred.cache_clear()
    choice.setenv(panels.SWITCH_ENV, "mkl")
    with pytest.raises(ValueError, match="DISAGG_CPU_LINEAR must be 'panels' or 'onednn', got 'mkl'"):
        panels.preferred()


def test_panels_suit_avx2_cpus_without_avx512(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert panels.cpu_suits_panels(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512bw\n")
    assert not panels.cpu_suits_panels(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 sse4_2 avx\n")  # no AVX2
    assert not panels.cpu_suits_panels(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # an Arm CPU's
    assert not panels.cpu_suits_panels(cpuinfo)
    assert not panels.cpu_suits_panels(tmp_path / "missing")
