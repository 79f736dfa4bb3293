"""Paged decode attention as a Triton kernel: reads K and V straight from the
paged cache through the block tables, with no padded gather.

The plain path (attention._decode) first copies every decode sequence's whole
context into a padded [Bd, max_ctx, kvh, hd] tensor, per layer and per step;
this kernel streams the same keys and values once, tile by tile, and keeps a
running (online) softmax, so the only memory traffic is the cache itself.

One program handles one (sequence, KV head) pair and all the query heads that
share that KV head (GQA), so each K/V tile is loaded once for the whole group.

Triton is optional: without it (CPU-only installs) `is_available()` is False
and this module still imports. Under TRITON_INTERPRET=1 the kernel runs on CPU
tensors (used by the tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the plain PyTorch path serves
    triton = None
    tl = None

# Query heads of one KV head are padded up to this many rows: tl.dot needs
# at least 16 rows, and a decode step is bound by reading the cache, not by math.
_MIN_ROWS = 16
# Cache positions read per loop iteration; tiles may span several blocks.
_TILE = 32


def is_available() -> bool:
    """Whether the kernel can be launched at all (Triton imports)."""
    return triton is not None


def _paged_decode_body(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, scale,  # type: ignore[no-untyped-def]
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb,
    block_size, group, head_dim,
    ROWS: tl.constexpr, HEAD: tl.constexpr, TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)  # tokens in this sequence's cache, >= 1

    row = tl.arange(0, ROWS)  # query heads of this KV head, padded
    dim = tl.arange(0, HEAD)  # head_dim, padded to a power of two
    col = tl.arange(0, TILE)  # cache positions within a tile
    row_ok = row < group
    dim_ok = dim < head_dim

    # q: [ROWS, HEAD] in the cache's dtype, so both dots see one operand type
    heads = kv_head * group + row
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dim[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(cache_ptr.dtype.element_ty)

    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD], tl.float32)
    table = tables_ptr + seq * stride_tb
    for start in range(0, ctx, TILE):
        pos = start + col  # [TILE]
        pos_ok = pos < ctx
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        # offset of each position's K row; its V row is stride_ckv further
        base = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch  # [TILE]
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + base[:, None] + dim[None, :], mask=kv_mask, other=0.0)  # [TILE, HEAD]
        v = tl.load(cache_ptr + stride_ckv + base[:, None] + dim[None, :], mask=kv_mask, other=0.0)

        # ieee: fp32 caches must not silently drop to tf32 (no effect on 16-bit types)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [ROWS, TILE] fp32
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        # every tile holds at least one valid position, so new_max is finite
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        rescale = tl.exp(run_max - new_max)  # [ROWS]; 0 on the first tile
        p = tl.exp(scores - new_max[:, None])  # [ROWS, TILE]
        run_sum = run_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        run_max = new_max

    out = acc / run_sum[:, None]  # [ROWS, HEAD]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dim[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


# Decorated here, not with @, so that the module imports without Triton.
# Whether it runs compiled or interpreted is fixed by TRITON_INTERPRET as
# Triton is first imported (its own library functions are decorated then).
_paged_decode = triton.jit(_paged_decode_body) if triton is not None else None


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q: [Bd, heads, hd]; layer_cache: [num_blocks, 2, block_size, kvh, hd];
    block_tables: [Bd, max_blocks] int32; context_lens: [Bd] int32, each >= 1
    and covered by its table. Returns [Bd, heads, hd] in q's dtype.
    """
    if _paged_decode is None:
        raise RuntimeError("paged_decode_attention needs the triton package")
    batch, heads, head_dim = q.shape
    num_blocks, two, block_size, kv_heads, cache_hd = layer_cache.shape
    if two != 2 or cache_hd != head_dim or heads % kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(layer_cache.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"{batch} queries but tables {tuple(block_tables.shape)}, "
                         f"lens {tuple(context_lens.shape)}")
    devices = {t.device for t in (q, layer_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {devices}")
    # the kernel steps rows by stride and the head dimension by 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert layer_cache.stride(-1) == 1, "the cache's head_dim must be contiguous"
    assert block_tables.stride(-1) == 1, "block table rows must be contiguous"

    group = heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _paged_decode[(batch, kv_heads)](
        q, layer_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        block_tables.stride(0),
        block_size, group, head_dim,
        ROWS=max(_MIN_ROWS, triton.next_power_of_2(group)),
        HEAD=max(16, triton.next_power_of_2(head_dim)),
        TILE=_TILE,
    )
    return out
