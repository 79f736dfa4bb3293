"""Tiny random Hugging Face models (Llama, Qwen2, Qwen3) and a hand-driven paged cache.

Fixtures for every engine test:
- `tiny_model(family, tied=False, max_shard_size=None) -> Path`: a folder from
  `disagg.testing.tiny_model.build_tiny_model`, built once per session per
  argument set.
- `tiny_model_dir`: the same, parametrized over the three families (untied).
- `paged_cache`: the PagedCache class, which builds ForwardBatch objects by
  hand, the way the engine's model runner does.
- `builtin_model_dir`: the embedded default model's folder (session; slow the first time).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from disagg.testing.tiny_model import FAMILIES, build_tiny_model
from disagg.workers.engine.forward_batch import ForwardBatch


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, bool, str | None], Path] = {}

    def get(family: str, tied: bool = False, max_shard_size: str | None = None) -> Path:
        key = (family, tied, max_shard_size)
        if key not in cache:
            dest = tmp_path_factory.mktemp(f"tiny-{family}-{'tied' if tied else 'untied'}")
            cache[key] = build_tiny_model(family, dest, tied=tied, max_shard_size=max_shard_size)
        return cache[key]

    return get


@pytest.fixture(params=FAMILIES)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(request.param)


class PagedCache:
    """A KV cache tensor plus per-sequence block tables, driven by hand.

    Physical block ids are handed out in a shuffled order, so that a test
    passes only if every read and write goes through the block tables.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=self.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens in the cache per sequence

    def _slot(self, seq: int, position: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size <= position:
            table.append(self.free.pop())
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def share_prefix(self, source: int, dest: int, num_blocks: int) -> None:
        """Starts `dest` with the first full blocks of `source`, as a prefix-cache hit does."""
        assert self.lengths[source] >= num_blocks * self.block_size, "only full blocks can be shared"
        self.tables[dest] = self.tables[source][:num_blocks]
        self.lengths[dest] = num_blocks * self.block_size

    def batch(self, chunks: dict[int, list[int]]) -> ForwardBatch:
        """One step that appends chunks[seq] (token ids) to each sequence; logits for every token."""
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            for i, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.lengths[seq] = start + len(tokens)
            query_lens.append(len(tokens))
            context_lens.append(self.lengths[seq])
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        on = {"device": self.device}
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, **on),
            positions=torch.tensor(positions, dtype=torch.int64, **on),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **on),
            query_lens=query_lens,
            context_lens=torch.tensor(context_lens, dtype=torch.int32, **on),
            block_tables=torch.tensor(tables, dtype=torch.int32, **on),
            logits_indices=torch.arange(len(ids), dtype=torch.int64, **on),
        )


@pytest.fixture
def paged_cache() -> type[PagedCache]:
    return PagedCache


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    """The embedded default (SmolLM2-135M-Instruct) as a Hugging Face folder, converted
    into the user cache on first use (about a minute); skips when the package is missing."""
    from disagg.workers.engine.loader import ModelLoadError, default_cache_dir, resolve_model_dir

    try:
        return resolve_model_dir("builtin:smollm2-135m", default_cache_dir())
    except ModelLoadError as e:
        pytest.skip(str(e))
