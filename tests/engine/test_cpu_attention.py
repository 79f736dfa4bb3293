"""The CPU paged decode kernel (csrc/paged_decode.c) against the padded gather path.

The kernel is built with the machine's C compiler; where there is none, the
engine serves with the gather path and these tests are skipped (the skip says so).
"""

from __future__ import annotations

import pytest
import torch

from disagg.workers.engine import cpu_attention
from disagg.workers.engine.attention import build_metadata, decode_kernel
from tests.engine.decode_steps import (
    KV_HEADS, attend, context_lens_for, decode_step, mixed_step_through, random_q,
)

pytestmark = pytest.mark.skipif(not cpu_attention.is_available(), reason="no C compiler to build the CPU kernel")
kernel = cpu_attention.paged_decode_attention


@pytest.mark.parametrize("head_dim", [32, 40, 64, 128])  # 40: no vector loop takes it whole
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_kernel_matches_the_gather_path_fp32(paged_cache: type, block_size: int, group: int, head_dim: int) -> None:
    lens = context_lens_for(block_size) + [300]
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=torch.float32, device="cpu")
    q = random_q(len(lens), group, head_dim, torch.float32, "cpu")
    kv = torch.zeros(len(lens), KV_HEADS, head_dim)
    kernel_meta = build_metadata(batch, block_size, kernel=kernel)
    assert kernel_meta.decode is not None and kernel_meta.decode.padded is None
    # the tables really are shuffled: a kernel ignoring them would read other blocks
    assert not torch.equal(kernel_meta.decode.block_tables[:, 0], torch.arange(len(lens), dtype=torch.int32))
    got = attend(q, kv, layer_cache, kernel_meta)
    want = attend(q, kv, layer_cache, build_metadata(batch, block_size))
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("block_size", "group", "head_dim"), [(16, 3, 64), (4, 8, 128), (1, 1, 32), (16, 3, 48)])
def test_kernel_reads_a_bf16_cache(paged_cache: type, block_size: int, group: int, head_dim: int) -> None:
    """A bf16 cache and queries against the gather path in fp32 on the same (rounded) values
    (head_dim 48: the scalar loops finish what 32-wide bf16 pairs leave)."""
    lens = context_lens_for(block_size)
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=torch.bfloat16, device="cpu")
    q = random_q(len(lens), group, head_dim, torch.bfloat16, "cpu")
    kv = torch.zeros(len(lens), KV_HEADS, head_dim)
    got = attend(q, kv.bfloat16(), layer_cache, build_metadata(batch, block_size, kernel=kernel))
    want = attend(q.float(), kv, layer_cache.float(), build_metadata(batch, block_size))
    assert got.dtype == torch.bfloat16
    # the kernel computes in fp32 and rounds once: within one bf16 rounding of the fp32 result
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_kernel_output_lands_in_the_decode_rows_of_a_mixed_step(paged_cache: type) -> None:
    got, want = mixed_step_through(kernel, paged_cache)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_extreme_scores_stay_finite(paged_cache: type) -> None:
    """Scores far apart (a softmax of one hot key) and far below zero: the online max keeps exp in range."""
    block_size, head_dim = 4, 32
    lens = [1, 7, 40]
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=torch.float32, device="cpu")
    layer_cache.mul_(40.0)
    q = random_q(len(lens), 2, head_dim, torch.float32, "cpu") * 40.0
    kv = torch.zeros(len(lens), KV_HEADS, head_dim)
    got = attend(q, kv, layer_cache, build_metadata(batch, block_size, kernel=kernel))
    want = attend(q, kv, layer_cache, build_metadata(batch, block_size))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_engine_picks_the_kernel_for_shapes_it_takes() -> None:
    cache = torch.zeros(2, 4, 2, 16, KV_HEADS, 64)  # [layers, blocks, 2, block_size, kvh, hd]
    assert decode_kernel(cache, num_heads=KV_HEADS * 3) is kernel
    assert decode_kernel(cache.half(), num_heads=KV_HEADS * 3) is None, "no fp16 kernel on the CPU"
    assert decode_kernel(cache, num_heads=KV_HEADS * 64) is None, "a group beyond the kernel's buffers"
    assert decode_kernel(torch.zeros(2, 4, 2, 16, KV_HEADS, 512), num_heads=KV_HEADS) is None


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_attention.SWITCH_ENV, "gather")
    cpu_attention._kernels.cache_clear()
    try:
        assert not cpu_attention.is_available()
        assert decode_kernel(torch.zeros(2, 4, 2, 16, KV_HEADS, 64), num_heads=KV_HEADS) is None
    finally:
        monkeypatch.undo()
        cpu_attention._kernels.cache_clear()
    assert cpu_attention.is_available()
