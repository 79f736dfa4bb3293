"""Projections from panel-packed weights (models/panels.py, csrc/panel_linear*.c) against F.linear: float32 and bf16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from disagg.workers.engine import cpu_kernels
from disagg.workers.engine.models import grids, panels
from disagg.workers.engine.models.packing import PackedLinear, packing_available

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler to build the CPU kernels")
needs_bf16_kernel = pytest.mark.skipif(not panels.preferred(torch.bfloat16),
                                       reason="bf16 panels need AMX (and Linux's leave) or AVX-512 BF16")
BF16_WIDTHS = panels.bf16_kernel().widths if panels.bf16_kernel() else (panels.BF16_PANEL,)


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


def test_packed_linear_takes_float32_panels_where_chosen(choice: pytest.MonkeyPatch) -> None:
    choice.setenv(panels.SWITCH_ENV, "panels")
    weight, bias = torch.randn(48, 40), torch.randn(48)
    layer = PackedLinear(weight, bias)
    assert layer.in_panels and "layout=panels" in repr(layer)
    x = torch.randn(9, 40)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def bf16_sums_agree(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """got = x @ weight.T + bias in bf16 with float32 sums: torch's float32 result rounded once,
    up to the sums' order: within float32's bound for a sum of k terms, then one bf16 step, and rarely."""
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    k = x.shape[-1]
    order = F.linear(x.float().abs(), weight.float().abs()) * k * 2.0 ** -24
    one_step = want.float().abs() * 2.0 ** -7
    assert ((got.float() - want.float()).abs() <= order + one_step).all()
    assert (got == want).float().mean() >= 0.99


# rows: AMX's tail of 1 row alone, tails beside blocks of 16 (17, 31, 33), a block pair (32), and 300:
# two blocks of BLOCK_ROWS (256); the vectors' passes of 6 and 12 rows and their tails (5, 7, 13).
# (n, k): a partial last panel (40, 100), one past a tile's 16 columns (17); threads sharing a panel (960).
@needs_bf16_kernel
@pytest.mark.parametrize("width", BF16_WIDTHS)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 15, 16, 17, 31, 32, 33, 300])
@pytest.mark.parametrize("n, k", [(40, 64), (100, 64), (17, 32), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panel_linear_equals_f_linear(width: int, rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bf16_sums_agree(panels.panel_linear(x, panels.pack(weight, width), n, b), x, weight, b)


@needs_bf16_kernel
def test_one_thread_takes_every_panel_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    weight, b = torch.randn(100, 64, generator=gen).bfloat16(), torch.randn(100, generator=gen).bfloat16()
    x = torch.randn(9, 64, generator=gen).bfloat16()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for width in BF16_WIDTHS:
        bf16_sums_agree(panels.panel_linear(x, panels.pack(weight, width), 100, b), x, weight, b)


@pytest.mark.parametrize("width", [32, 64])
def test_bf16_panels_are_pairs_of_k(width: int) -> None:
    weight = torch.randn(40, 64).bfloat16()
    packed = panels.pack(weight, width)
    assert packed.shape == (-(-40 // width), 32, width, 2) and packed.is_contiguous()
    for n, k in ((0, 0), (5, 1), (31, 62), (33, 7), (39, 63)):
        assert packed[n // width, k // 2, n % width, k % 2] == weight[n, k]
    assert not packed[-1, :, 40 % width:].any()
    with pytest.raises(ValueError, match="bf16 panels need K a multiple of 32, got a weight of 40 columns"):
        panels.pack(torch.randn(8, 40).bfloat16())


@needs_bf16_kernel
def test_packed_linear_reads_onednns_bf16_copy_for_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, bias = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()  # 48: oneDNN pads to 64 columns
    layer = PackedLinear(weight, bias)
    assert layer.onednn_panels is not None and "small steps by the bf16 kernel" in repr(layer)
    rows_read: list[int] = []
    read = panels.panel_linear_at

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        rows_read.append(x.shape[0])
        return read(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(panels, "panel_linear_at", counted)
    for rows in (3, panels.BF16_MAX_ROWS, panels.BF16_MAX_ROWS + 1):  # the last: oneDNN's
        x = torch.randn(rows, 64).bfloat16()
        bf16_sums_agree(layer(x), x, weight, bias)
    assert rows_read == [3, panels.BF16_MAX_ROWS]
    with pytest.raises(ValueError, match="panel_linear: x torch.float32 and bias against torch.bfloat16 panels"):
        layer(torch.randn(3, 64))
    assert PackedLinear(torch.randn(48, 40).bfloat16(), None).onednn_panels is None  # K not a multiple of 32
    on_grid = PackedLinear(torch.zeros(48, 64).bfloat16(), None, grids.find_grid(torch.zeros(48, 64)))
    assert on_grid.onednn_panels is not None and on_grid.grid is None, "our kernel serves small steps, not codes"


@needs_bf16_kernel
def test_a_onednn_copy_is_read_only_when_its_bytes_are_the_panels(caplog: pytest.LogCaptureFixture) -> None:
    weight = torch.randn(64, 64).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    found = panels.onednn_panels(weight, packed)
    assert found is not None and found.address == torch.ops.mkldnn.data_ptr(packed)
    assert found.width in BF16_WIDTHS
    assert panels.onednn_panels(weight.float(), packed) is None
    assert "not in our panels' layout" not in caplog.text
    panels._warn_layout_differs.cache_clear()
    assert panels.onednn_panels(weight + 1, packed) is None  # as if oneDNN had blocked it otherwise
    assert panels.onednn_panels(torch.randn(32, 64).bfloat16(), packed) is None  # another size
    assert caplog.text.count("oneDNN's packed bf16 weights are not in our panels' layout here") == 1


def test_the_switch_chooses_and_rejects_what_it_does_not_know(choice: pytest.MonkeyPatch) -> None:
    choice.setenv(panels.SWITCH_ENV, "onednn")
    assert not panels.preferred() and not panels.preferred(torch.bfloat16)
    assert not PackedLinear(torch.randn(16, 8), None).in_panels
    if packing_available(torch.device("cpu"), torch.bfloat16):  # where oneDNN packs bf16 at all (not on AVX2 CPUs)
        assert PackedLinear(torch.randn(16, 32).bfloat16(), None).onednn_panels is None
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
