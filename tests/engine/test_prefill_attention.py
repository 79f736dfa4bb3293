"""The CPU prefill attention kernel (csrc/prefill_attention.c) against SDPA.

The kernel runs in float32 (bf16 prompts widened to it) where the CPU has AVX2
and FMA and a C compiler builds it; elsewhere the engine serves prompts with SDPA and these tests are
skipped (the skip says so).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.workers.engine import cpu_attention
from disagg.workers.engine.attention import build_metadata
from tests.engine.decode_steps import KV_HEADS, attend, random_q

QUERIES = torch.zeros(1, KV_HEADS, 64)
pytestmark = pytest.mark.skipif(not cpu_attention.supports_prefill(QUERIES, QUERIES),
                                reason="no AVX2 and FMA here (or no C compiler): prompts take SDPA")


def causal_mask(q_len: int, ctx: int) -> torch.Tensor:
    """The queries are the last q_len positions; each sees the keys up to its own."""
    return torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch's SDPA in q's dtype: [q_len, heads, hd] over [ctx, kvh, hd]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                       values.transpose(0, 1)[None], attn_mask=causal_mask(q.shape[0], keys.shape[0]),
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def random_rows(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    assert cpu_attention.supports_prefill(q, keys)
    cpu_attention.prefill_attention(q, keys, values, out, scale)
    return out


# (q_len, ctx, heads, kv_heads, head_dim): a block's tail rows, keys short of a tile, a cached prefix,
# several softmax chunks of 256 keys, GQA groups of 1 to 7, head_dim 16 to 256.
SHAPES = [(256, 256, 9, 3, 64), (5, 5, 9, 3, 64), (17, 40, 4, 2, 32), (1, 33, 2, 2, 64), (300, 700, 8, 1, 128),
          (600, 600, 14, 2, 64), (70, 70, 4, 4, 256), (33, 1000, 6, 3, 96), (7, 300, 2, 1, 16)]


@pytest.mark.parametrize(("q_len", "ctx", "heads", "kv_heads", "head_dim"), SHAPES)
def test_kernel_matches_sdpa(q_len: int, ctx: int, heads: int, kv_heads: int, head_dim: int) -> None:
    q = random_rows(q_len, heads, head_dim, seed=1)
    keys, values = random_rows(ctx, kv_heads, head_dim, seed=2), random_rows(ctx, kv_heads, head_dim, seed=3)
    scale = head_dim ** -0.5
    got = run_kernel(q, keys, values, scale)
    assert got.dtype == torch.float32
    # float32 sums in another order than SDPA's: both within a few 1e-7 of float64 (measured up to 1.3e-6)
    want = sdpa(q.double(), keys.double(), values.double(), scale).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, sdpa(q, keys, values, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("q_len", "ctx", "heads", "kv_heads", "head_dim"), [SHAPES[0], SHAPES[2], SHAPES[7]])
def test_a_bf16_prompt_is_its_float32_attention_rounded_once(q_len: int, ctx: int, heads: int, kv_heads: int,
                                                             head_dim: int) -> None:
    """bf16 queries, keys and values are float32 values: the kernel attends in float32 and
    rounds the output to bf16 once, as close to float64 as SDPA's bf16 path (which also rounds
    the probabilities) or closer."""
    q = random_rows(q_len, heads, head_dim, seed=4).bfloat16()
    keys = random_rows(ctx, kv_heads, head_dim, seed=5).bfloat16()
    values = random_rows(ctx, kv_heads, head_dim, seed=6).bfloat16()
    scale = head_dim ** -0.5
    got = run_kernel(q, keys, values, scale)
    assert got.dtype == torch.bfloat16
    exact = sdpa(q.double(), keys.double(), values.double(), scale)
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-6)
    assert (got.double() - exact).abs().mean() <= (sdpa(q, keys, values, scale).double() - exact).abs().mean()


def test_strided_rows_are_read_and_written_in_place() -> None:
    """Queries, keys and values as column slices of one wider row (a fused QKV projection's output),
    the output into its slice of a step's rows: nothing outside the slice changes."""
    q_len, heads, kv_heads, head_dim = 40, 6, 2, 64
    fused = random_rows(q_len, (heads + 2 * kv_heads) * head_dim, seed=4)
    q = fused[:, :heads * head_dim].view(q_len, heads, head_dim)
    keys = fused[:, heads * head_dim:(heads + kv_heads) * head_dim].view(q_len, kv_heads, head_dim)
    values = fused[:, (heads + kv_heads) * head_dim:].view(q_len, kv_heads, head_dim)
    assert not q.is_contiguous() and keys.stride(0) == values.stride(0) == fused.stride(0)
    step_out = torch.full((q_len + 8, heads, head_dim), 7.0)
    cpu_attention.prefill_attention(q, keys, values, step_out[4:4 + q_len], 0.125)
    torch.testing.assert_close(step_out[4:4 + q_len], run_kernel(q.contiguous(), keys.contiguous(),
                                                                 values.contiguous(), 0.125), atol=0, rtol=0)
    assert bool((step_out[:4] == 7.0).all()) and bool((step_out[4 + q_len:] == 7.0).all())


def test_extreme_scores_stay_finite() -> None:
    """Scores hundreds apart (a softmax of one hot key, others e^-87 below): the running max keeps exp
    in range across chunks, a later chunk raising it."""
    q_len, ctx, heads, head_dim = 20, 600, 2, 64
    q = random_rows(q_len, heads, head_dim, seed=5) * 8
    keys, values = random_rows(ctx, 1, head_dim, seed=6) * 8, random_rows(ctx, 1, head_dim, seed=7)
    keys[590] = q[-1, 0]  # the late chunk's hot key, seen by the last rows only
    got = run_kernel(q, keys, values, 1.0)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, sdpa(q.double(), keys.double(), values.double(), 1.0).float(),
                               atol=1e-4, rtol=1e-4)


def test_a_prompt_after_a_cached_prefix_through_paged_attention(paged_cache: type,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with a decode row and a prompt of 37 tokens after 51 cached ones (keys read through its
    shuffled block table): the kernel's rows equal SDPA's, the decode row the same."""
    block_size, group, head_dim, cached, prompt = 16, 3, 64, 51, 37
    cache = paged_cache(1, KV_HEADS, head_dim, block_size=block_size, num_blocks=16)
    cache.batch({0: [0] * 5, 1: [0] * cached})
    batch = cache.batch({0: [0], 1: [0] * prompt})
    layer_cache = cache.kv_cache[0]
    layer_cache.copy_(random_rows(*layer_cache.shape, seed=9))
    q = random_q(1 + prompt, group, head_dim, torch.float32, "cpu")
    kv = torch.zeros(1 + prompt, KV_HEADS, head_dim)
    meta = build_metadata(batch, block_size)
    assert meta.prefills[0].k_rows is not None, "the prompt reads a cached prefix"
    got = attend(q, kv, layer_cache, meta)
    monkeypatch.setattr(cpu_attention, "supports_prefill", lambda q, keys: False)
    want = attend(q, kv, layer_cache, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shapes_it_does_not_take_go_to_sdpa_or_are_refused() -> None:
    q = torch.zeros(4, 4, 40)  # head_dim not a multiple of 16
    assert not cpu_attention.supports_prefill(q, q[:, :2])
    q = torch.zeros(4, 4, 64)
    assert not cpu_attention.supports_prefill(q.half(), q.half()[:, :2]), "float16 prompts keep SDPA"
    assert not cpu_attention.supports_prefill(q.bfloat16(), q[:, :2]), "queries and keys of two dtypes"
    assert not cpu_attention.supports_prefill(q, q[:, :3]), "heads not a multiple of the KV heads"
    q = random_rows(8, 2, 64, seed=8)
    with pytest.raises(ValueError, match="8 queries over 4 keys"):
        cpu_attention.prefill_attention(q, q[:4, :1], q[:4, :1], torch.empty_like(q), 0.125)
