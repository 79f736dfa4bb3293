"""One decode step over a random paged cache: what the decode kernels' tests share."""

from __future__ import annotations

import torch

from disagg.workers.engine.attention import AttentionMetadata, DecodeKernel, build_metadata, paged_attention
from disagg.workers.engine.forward_batch import ForwardBatch

SCALE = 0.125
KV_HEADS = 2


def context_lens_for(block_size: int) -> list[int]:
    """Lengths at and around block boundaries, plus one spanning several kernel tiles."""
    lens = {1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 70}
    return sorted(n for n in lens if n >= 1)


def decode_step(paged_cache: type, lens: list[int], *, block_size: int, head_dim: int,
                dtype: torch.dtype, device: str, prefill_len: int = 0) -> tuple[torch.Tensor, ForwardBatch]:
    """A cache of random K/V and one step in which sequence i reaches lens[i] tokens with
    one new token; with prefill_len, one more sequence adds that many tokens in the same step.

    Returns the layer cache [num_blocks, 2, block_size, kvh, hd] and the step's batch.
    """
    num_blocks = sum(-(-n // block_size) for n in lens) + 4 + prefill_len // block_size
    cache = paged_cache(1, KV_HEADS, head_dim, block_size=block_size, num_blocks=num_blocks,
                        dtype=dtype, device=device, seed=block_size)
    for seq, n in enumerate(lens):
        if n > 1:
            cache.batch({seq: [0] * (n - 1)})  # only allocates the blocks and advances the length
    chunks = {seq: [0] for seq in range(len(lens))}
    if prefill_len:
        chunks[len(lens)] = [0] * prefill_len
    batch = cache.batch(chunks)
    layer_cache = cache.kv_cache[0]
    layer_cache.copy_(torch.randn(layer_cache.shape, generator=torch.Generator().manual_seed(1)))
    return layer_cache, batch


def attend(q: torch.Tensor, kv: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    # the step's own K/V: read only by a prefill with nothing cached before it
    return paged_attention(q, kv, kv, layer_cache, meta, SCALE)


def random_q(num_tokens: int, group: int, head_dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(num_tokens, KV_HEADS * group, head_dim, generator=gen).to(device=device, dtype=dtype)


def mixed_step_through(kernel: DecodeKernel, paged_cache: type) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows among a prefill's rows in one step: (attention with `kernel`, with the gather path)."""
    block_size, group, head_dim, prefill_len = 4, 3, 32, 6
    lens = [3, 4, 9]
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=torch.float32, device="cpu", prefill_len=prefill_len)
    num_tokens = len(lens) + prefill_len
    q = random_q(num_tokens, group, head_dim, torch.float32, "cpu")
    kv = torch.randn(num_tokens, KV_HEADS, head_dim, generator=torch.Generator().manual_seed(3))
    kernel_meta = build_metadata(batch, block_size, kernel=kernel)
    assert kernel_meta.decode is not None and kernel_meta.decode.token_rows is not None
    return attend(q, kv, layer_cache, kernel_meta), attend(q, kv, layer_cache, build_metadata(batch, block_size))
