"""The paged KV pool: one tensor for every layer, sized from a block count or
a memory budget.

Layout (the same contract as ForwardBatch and the transfer engine):
    pool: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
so one block of one layer, K then V, is one contiguous run of
`layer_block_bytes` bytes at `block_offset(layer, block)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.workers.engine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_KV_CACHE_FRACTION,
    EngineConfig,
)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one block, which decides every size below."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * element

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across all layers: what a block costs the pool."""
        return self.num_layers * self.layer_block_bytes

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def num_blocks_for_bytes(self, budget: int) -> int:
        return budget // self.block_bytes


class KVCache:
    """The pool tensor, zero-filled: padded attention reads of never-written
    slots must see finite numbers (uninitialised memory may hold NaN)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block: one block takes {spec.block_bytes} bytes"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        self.tensor = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def block_offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) inside the pool."""
        assert 0 <= layer < self.spec.num_layers and 0 <= block < self.num_blocks, "block out of range"
        return (layer * self.num_blocks + block) * self.spec.layer_block_bytes

    def block(self, layer: int, block: int) -> torch.Tensor:
        """View of one block of one layer: [2, block_size, num_kv_heads, head_dim]."""
        return self.tensor[layer, block]


def resolve_num_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """Blocks for the pool: the configured count, else the budget, else a
    device default (call after the weights are on the device)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        return spec.num_blocks_for_bytes(config.kv_cache_memory_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return spec.num_blocks_for_bytes(int(free * DEFAULT_GPU_KV_CACHE_FRACTION))
    return spec.num_blocks_for_bytes(DEFAULT_CPU_KV_CACHE_BYTES)
