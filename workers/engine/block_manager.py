"""Paged-KV bookkeeping: which request holds which block, and the prefix cache.

Plain Python over block ids; the tensors live in kv_cache.py. Every block is
in exactly one of three states:

    free       ref_count 0, no content worth keeping       -> `_free`
    evictable  ref_count 0, a full block in the prefix cache -> `_evictable` (LRU order)
    used       ref_count > 0, in the block table of ref_count requests

A full block is keyed by (hash of everything before it, its own tokens), so a
block matches only when its whole prefix matches. Only full, computed blocks
are ever shared, so a request only ever writes into blocks it owns alone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from disagg.workers.engine.request import Request

BlockKey = tuple[int, tuple[int, ...]]  # (chain hash of the prefix, the block's tokens)
_ROOT_HASH = 0x5EED


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0, "the pool needs blocks of at least one token"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[BlockKey, int] = {}
        self.num_cache_hit_blocks = 0  # lifetime counter, for metrics

    # --- counts -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: truly free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # --- prefix cache lookup ----------------------------------------------------

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest full-block prefix of the request.

        Leaves at least the last token uncached: it must run to give logits.
        Takes no references; pass the result to `can_allocate`/`allocate`.
        Nothing for a request that asks for prompt logprobs: every prompt position must run.
        """
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block = self._cached.get(self._key(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    # --- paired verbs -------------------------------------------------------

    def can_allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether `allocate` can give a request with no blocks its cached
        prefix plus room for `num_new_tokens` more tokens."""
        num_tokens = len(cached_blocks) * self.block_size + num_new_tokens
        num_fresh = request.num_blocks_for(num_tokens) - len(cached_blocks)
        # Evictable hits leave the free count when we take them.
        num_revived = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        return num_fresh + num_revived <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> None:
        """Give a request with no blocks its cached prefix and room for
        `num_new_tokens` more; its computed tokens start after the prefix."""
        assert not request.block_table, f"{request} already holds blocks"
        assert self.can_allocate(request, cached_blocks, num_new_tokens), "allocate without room"
        for block in cached_blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        request.block_table = list(cached_blocks)
        request.num_committed_blocks = len(cached_blocks)
        request.num_computed_tokens = len(cached_blocks) * self.block_size
        self.num_cache_hit_blocks += len(cached_blocks)
        self._grow(request, request.num_computed_tokens + num_new_tokens)

    def can_append(self, request: Request, num_new_tokens: int = 1) -> bool:
        """Whether the request's blocks can grow to hold `num_new_tokens` more computed tokens."""
        needed = request.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return needed - len(request.block_table) <= self.num_free_blocks

    def append_slot(self, request: Request, num_new_tokens: int = 1) -> None:
        """Grow the request's blocks to hold `num_new_tokens` more computed tokens."""
        assert self.can_append(request, num_new_tokens), "append_slot without room"
        self._grow(request, request.num_computed_tokens + num_new_tokens)

    def free(self, request: Request) -> None:
        """Drop the request's references; its cached full blocks stay for reuse."""
        # Tail blocks first, so that LRU eviction takes a prefix's tail before its head.
        for block in reversed(request.block_table):
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._keys[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        request.block_table = []
        request.num_committed_blocks = 0

    def commit(self, request: Request) -> None:
        """Publish the request's newly computed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        self._extend_hashes(request, num_full)
        for i in range(request.num_committed_blocks, num_full):
            key = self._key(request, i)
            block = request.block_table[i]
            # Two requests may compute the same block at once: the first one wins,
            # the other's copy stays private and is freed normally.
            if key not in self._cached and self._keys[block] is None:
                self._cached[key] = block
                self._keys[block] = key
        request.num_committed_blocks = max(request.num_committed_blocks, num_full)

    # --- internals ----------------------------------------------------------

    def _grow(self, request: Request, num_tokens: int) -> None:
        for _ in range(request.num_blocks_for(num_tokens) - len(request.block_table)):
            block = self._take_block()
            self._ref_counts[block] = 1
            request.block_table.append(block)

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        key = self._keys[block]
        assert key is not None, f"evictable block {block} has no key"
        del self._cached[key]
        self._keys[block] = None
        return block

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(hash(self._key(request, i)))

    def _key(self, request: Request, index: int) -> BlockKey:
        parent = request.block_hashes[index - 1] if index else _ROOT_HASH
        return (parent, tuple(request.block_token_ids(index)))

    # --- checks -------------------------------------------------------------

    def check_integrity(self, live_requests: Iterable[Request] | None = None) -> None:
        """Assert every invariant of the pool; with the live requests, also that
        each reference count equals the number of block tables holding the block."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & self._evictable.keys(), "a block is both free and evictable"
        used = [b for b in range(self.num_blocks) if self._ref_counts[b] > 0]
        assert len(free) + len(self._evictable) + len(used) == self.num_blocks, (
            f"free {len(free)} + evictable {len(self._evictable)} + used {len(used)} "
            f"!= total {self.num_blocks}"
        )
        for block in free:
            assert self._ref_counts[block] == 0 and self._keys[block] is None, f"free block {block}"
        for block in self._evictable:
            assert self._ref_counts[block] == 0, f"evictable block {block} is referenced"
            assert self._keys[block] is not None, f"evictable block {block} has no key"
        for key, block in self._cached.items():
            assert self._keys[block] == key, f"cache entry of block {block} disagrees"
        assert sum(k is not None for k in self._keys) == len(self._cached), "stray block keys"
        if live_requests is not None:
            counts = [0] * self.num_blocks
            for request in live_requests:
                for block in request.block_table:
                    counts[block] += 1
            assert counts == self._ref_counts, "reference counts disagree with block tables"
