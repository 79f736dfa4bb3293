"""Paged attention in plain PyTorch: runs on CPU and CUDA.

The KV cache is one tensor for the whole model (see ForwardBatch):
    kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
A layer's cache, kv_cache[layer], is contiguous, so it is read here as flat rows
    rows: [num_blocks * 2 * block_size, num_kv_heads, head_dim]
where slot s (block b = s // block_size, offset o = s % block_size) keeps
    K in row  b * 2 * block_size + o
    V in row  b * 2 * block_size + block_size + o
Every index tensor below is built once per forward (AttentionMetadata) and
shared by all layers, so a layer's work is tensor ops only.

Decode steps skip the padded gather where a kernel reads K/V through the
block tables directly: triton_attention's on CUDA, cpu_attention's on a CPU
(see decode_kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.workers.engine import cpu_attention, triton_attention
from disagg.workers.engine.forward_batch import ForwardBatch

# (q [Bd, heads, hd], layer_cache, block_tables [Bd, max_blocks] int32, context_lens [Bd] int32, scale)
# -> [Bd, heads, hd]: attention of one new token per sequence, read through the block tables.
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class PaddedContext:
    """The plain path's gather: every decode sequence's context as padded cache rows."""

    k_rows: torch.Tensor  # [Bd * max_ctx] cache rows of each sequence's keys, padded, flattened
    v_rows: torch.Tensor  # [Bd * max_ctx]
    mask: torch.Tensor  # [Bd, 1, 1, max_ctx] bool, True where a key exists


@dataclass
class DecodeGroup:
    """Sequences that add one token each, attended as one batch."""

    token_rows: torch.Tensor | None  # [Bd] their rows in the step's tokens; None = all rows, in order
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, the decode sequences' tables
    context_lens: torch.Tensor  # [Bd] int32, tokens in each one's cache (>= 1)
    kernel: DecodeKernel | None  # reads the cache by block table; None: the padded gather
    padded: PaddedContext | None  # set when kernel is None


@dataclass
class PrefillSegment:
    """One sequence that adds several tokens: its query rows attend causally to its context."""

    start: int  # its rows in the step's tokens are [start, end)
    end: int
    k_rows: torch.Tensor | None  # [ctx] cache rows; None when nothing was cached before (keys = new tokens)
    v_rows: torch.Tensor | None  # [ctx]
    mask: torch.Tensor | None  # [q_len, ctx] bool causal mask shifted by the cached prefix; None = plain causal


@dataclass
class AttentionMetadata:
    write_k_rows: torch.Tensor  # [T] cache row of each new token's key
    write_v_rows: torch.Tensor  # [T]
    decode: DecodeGroup | None
    prefills: list[PrefillSegment]


def decode_kernel(kv_cache: torch.Tensor, num_heads: int) -> DecodeKernel | None:
    """The kernel that serves decode attention over this cache, or None for the padded gather."""
    if kv_cache.device.type == "cuda":
        return triton_attention.paged_decode_attention if triton_attention.is_available() else None
    return cpu_attention.paged_decode_attention if cpu_attention.supports(kv_cache, num_heads) else None


def build_metadata(batch: ForwardBatch, block_size: int, kernel: DecodeKernel | None = None) -> AttentionMetadata:
    """Translates slots and block tables into cache rows, once per forward.

    kernel: what reads the decode rows' context through the block tables
    (decode_kernel picks it); None copies it into a padded tensor first.
    """
    device = batch.input_ids.device
    row_stride = 2 * block_size  # rows per block: K rows then V rows
    slots = batch.slot_mapping.to(device=device, dtype=torch.int64)
    write_k = (slots // block_size) * row_stride + slots % block_size
    block_tables = batch.block_tables.to(device=device, dtype=torch.int64)
    context_lens = [int(n) for n in batch.context_lens.tolist()]
    assert len(context_lens) == batch.num_seqs, "context_lens must have one entry per sequence"
    assert sum(batch.query_lens) == batch.num_tokens, "query_lens must sum to the number of tokens"

    def context_rows(table: torch.Tensor, ctx: int) -> torch.Tensor:
        # table: [..., max_blocks] -> key rows [..., ctx] of positions 0..ctx-1
        cols = torch.arange(ctx, device=device)
        assert ctx <= table.shape[-1] * block_size, f"block table too short for {ctx} tokens"
        return table.index_select(-1, cols // block_size) * row_stride + cols % block_size

    starts = [0]
    for q_len in batch.query_lens:
        starts.append(starts[-1] + q_len)
    decode_seqs = [i for i, q_len in enumerate(batch.query_lens) if q_len == 1]
    decode = None
    if decode_seqs:
        lens = [context_lens[i] for i in decode_seqs]
        assert min(lens) >= 1, "a decode sequence has at least its new token in the cache"
        seq_index = torch.tensor(decode_seqs, device=device)
        decode_tables = block_tables.index_select(0, seq_index)  # [Bd, max_blocks]
        decode_lens = torch.tensor(lens, device=device)
        padded = None
        if kernel is None:
            max_ctx = max(lens)
            k_rows = context_rows(decode_tables, max_ctx).flatten()
            mask = torch.arange(max_ctx, device=device)[None, :] < decode_lens[:, None]
            padded = PaddedContext(k_rows, k_rows + block_size, mask[:, None, None, :])
        token_rows = None if len(decode_seqs) == batch.num_seqs else \
            torch.tensor([starts[i] for i in decode_seqs], device=device)
        decode = DecodeGroup(token_rows, decode_tables.to(torch.int32).contiguous(),
                             decode_lens.to(torch.int32), kernel, padded)

    prefills = []
    for i, q_len in enumerate(batch.query_lens):
        if q_len == 1:
            continue
        ctx = context_lens[i]
        assert ctx >= q_len, f"sequence {i}: context_len {ctx} < query_len {q_len}"
        if ctx == q_len:
            prefills.append(PrefillSegment(starts[i], starts[i + 1], None, None, None))
            continue
        k_rows = context_rows(block_tables[i], ctx)
        # query r sits at position ctx - q_len + r and sees keys 0..that position
        query_pos = torch.arange(ctx - q_len, ctx, device=device)
        mask = torch.arange(ctx, device=device)[None, :] <= query_pos[:, None]
        prefills.append(PrefillSegment(starts[i], starts[i + 1], k_rows, k_rows + block_size, mask))
    return AttentionMetadata(write_k, write_k + block_size, decode, prefills)


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Stores the new tokens' K/V ([T, kvh, hd]) in their slots of one layer's cache."""
    rows = layer_cache.view(-1, *layer_cache.shape[-2:])
    rows.index_copy_(0, meta.write_k_rows, k.to(rows.dtype))
    rows.index_copy_(0, meta.write_v_rows, v.to(rows.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of the new tokens over their sequences' cached context.

    q: [T, heads, hd]; k, v: [T, kvh, hd] (already written to the cache);
    layer_cache: [num_blocks, 2, block_size, kvh, hd]. Returns [T, heads, hd].
    """
    # NOTE: gathers use index_select/index_copy_: on CPU, advanced indexing
    # (rows[idx]) is about 1000x slower for these small row sets.
    rows = layer_cache.view(-1, *layer_cache.shape[-2:])
    if meta.decode is not None and meta.decode.token_rows is None:
        return _decode_any(q, layer_cache, meta.decode, scale)
    out = torch.empty_like(q)
    if meta.decode is not None:
        assert meta.decode.token_rows is not None
        token_rows = meta.decode.token_rows
        out.index_copy_(0, token_rows, _decode_any(q.index_select(0, token_rows), layer_cache, meta.decode, scale))
    for seg in meta.prefills:
        if seg.k_rows is None:
            keys, values = k[seg.start:seg.end], v[seg.start:seg.end]
        else:
            assert seg.v_rows is not None
            keys, values = rows.index_select(0, seg.k_rows), rows.index_select(0, seg.v_rows)
        if cpu_attention.supports_prefill(q, keys):
            cpu_attention.prefill_attention(q[seg.start:seg.end], keys, values, out[seg.start:seg.end], scale)
            continue
        # [1, heads, q_len, hd] against [1, kvh, ctx, hd]
        o = F.scaled_dot_product_attention(
            q[seg.start:seg.end].transpose(0, 1)[None], keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None], attn_mask=seg.mask, is_causal=seg.mask is None,
            scale=scale, enable_gqa=True)
        out[seg.start:seg.end] = o[0].transpose(0, 1)
    return out


def _decode_any(q: torch.Tensor, layer_cache: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
    # q: [Bd, heads, hd] -> [Bd, heads, hd], by the path build_metadata chose
    if group.kernel is not None:
        return group.kernel(q, layer_cache, group.block_tables, group.context_lens, scale)
    assert group.padded is not None
    return _decode(q, layer_cache.view(-1, *layer_cache.shape[-2:]), group.padded, scale)


def _decode(q: torch.Tensor, rows: torch.Tensor, padded: PaddedContext, scale: float) -> torch.Tensor:
    # q: [Bd, heads, hd]; keys/values gathered: [Bd, max_ctx, kvh, hd]
    batch_size, max_ctx = padded.mask.shape[0], padded.mask.shape[-1]
    # NOTE: on a CPU, SDPA of one query row runs 5x faster in fp32 than in
    # bf16 (measured with the embedded default's shapes), conversions included.
    compute = torch.float32 if rows.device.type == "cpu" else rows.dtype
    keys = rows.index_select(0, padded.k_rows).view(batch_size, max_ctx, *rows.shape[1:]).to(compute)
    values = rows.index_select(0, padded.v_rows).view(batch_size, max_ctx, *rows.shape[1:]).to(compute)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :].to(compute), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=padded.mask, scale=scale, enable_gqa=True)
    return o[:, :, 0, :].to(q.dtype)  # [Bd, heads, hd]
