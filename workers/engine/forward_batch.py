"""The tensors of one model step: the contract between the scheduler side
(model_runner builds it) and the model side (models read it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One forward pass over T new tokens that belong to B sequences.

    Tokens are flattened sequence after sequence, in the order of
    `query_lens`. Each token's K/V is written into the paged cache at its
    slot before attention reads the cache, so a sequence's attention covers
    its cached prefix and its new tokens alike.

    The paged cache is one tensor, so that a block of a layer (K and V) is one
    contiguous run of bytes that the transfer engine can move whole:
        kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each token's K/V
    query_lens: list[int]  # [B] new tokens per sequence, sum == T
    context_lens: torch.Tensor  # [B] int32, tokens in the cache after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each table's end
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states that need logits
    # Called with the layer index right after that layer's K/V is in the cache:
    # the prefill role pushes the layer to its decode while the next computes.
    on_layer_written: Callable[[int], None] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: attention may take its batched path."""
        return all(n == 1 for n in self.query_lens)
