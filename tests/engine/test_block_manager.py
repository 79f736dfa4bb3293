"""The paged-KV allocator: paired verbs, reference counts and the prefix cache."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from disagg.workers.engine.block_manager import BlockManager
from disagg.workers.engine.request import Request
from disagg.workers.engine.sampling_params import SamplingParams

BLOCK = 4


def make_request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(), block_size=BLOCK)


@pytest.fixture
def bm() -> Iterator[BlockManager]:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    yield manager
    manager.check_integrity()
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks


def prefill(bm: BlockManager, request: Request) -> None:
    """Allocate the whole prompt (after the cached prefix) and mark it computed."""
    cached = bm.match_prefix(request)
    num_new = request.num_tokens - len(cached) * BLOCK
    assert bm.can_allocate(request, cached, num_new)
    bm.allocate(request, cached, num_new)
    request.num_computed_tokens += num_new
    bm.commit(request)


def test_allocate_and_free_round_trip(bm: BlockManager) -> None:
    request = make_request(list(range(10)))
    prefill(bm, request)
    assert len(request.block_table) == 3  # ceil(10 / 4)
    assert len(set(request.block_table)) == 3
    assert bm.num_used_blocks == 3
    bm.check_integrity([request])
    bm.free(request)
    assert request.block_table == []
    assert bm.num_free_blocks == 8


def test_can_allocate_refuses_beyond_the_pool(bm: BlockManager) -> None:
    request = make_request(list(range(33)))  # needs 9 blocks of 4
    assert not bm.can_allocate(request, [], request.num_tokens)
    assert bm.can_allocate(request, [], 32)


def test_append_slot_grows_only_at_block_boundaries(bm: BlockManager) -> None:
    request = make_request(list(range(4)))
    prefill(bm, request)
    assert len(request.block_table) == 1
    for step in range(5):
        request.append_token(100 + step)
        assert bm.can_append(request, 1)
        bm.append_slot(request, 1)
        request.num_computed_tokens += 1
        assert len(request.block_table) == request.num_blocks
    assert len(request.block_table) == 3  # 9 tokens
    bm.check_integrity([request])
    bm.free(request)


def test_can_append_false_when_pool_is_full(bm: BlockManager) -> None:
    hog = make_request(list(range(28)), "hog")  # 7 blocks
    prefill(bm, hog)
    request = make_request(list(range(100, 104)), "r")  # 1 block, full
    prefill(bm, request)
    assert bm.num_free_blocks == 0
    request.append_token(7)
    assert not bm.can_append(request, 1)
    bm.free(hog)
    assert bm.can_append(request, 1)
    bm.free(request)


def test_prefix_cache_shares_full_blocks(bm: BlockManager) -> None:
    first = make_request(list(range(10)), "a")
    prefill(bm, first)
    second = make_request(list(range(9)) + [99, 98], "b")  # shares 2 full blocks
    cached = bm.match_prefix(second)
    assert cached == first.block_table[:2]
    prefill(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert second.num_computed_tokens == second.num_tokens
    assert bm.num_used_blocks == 4  # 2 shared + 1 + 1
    bm.check_integrity([first, second])
    bm.free(first)
    bm.check_integrity([second])
    bm.free(second)


def test_prefix_match_requires_the_whole_prefix(bm: BlockManager) -> None:
    first = make_request(list(range(12)), "a")
    prefill(bm, first)
    # Same second block, different first block: no hit at all.
    other = make_request([50, 51, 52, 53] + list(range(4, 12)) + [0], "b")
    assert bm.match_prefix(other) == []
    bm.free(first)


def test_full_hit_leaves_the_last_token_to_compute(bm: BlockManager) -> None:
    first = make_request(list(range(8)), "a")
    prefill(bm, first)
    again = make_request(list(range(8)), "b")
    cached = bm.match_prefix(again)
    assert cached == first.block_table[:1]  # not both: the last token must run
    prefill(bm, again)
    assert again.num_cached_tokens == 0  # set by the scheduler, not here
    bm.free(first)
    bm.free(again)


def test_freed_cached_blocks_are_reused_then_evicted_lru(bm: BlockManager) -> None:
    first = make_request(list(range(16)), "a")  # 4 full blocks
    prefill(bm, first)
    blocks = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 4
    # The cache still answers after the owner left.
    again = make_request(list(range(16)) + [1], "b")
    assert bm.match_prefix(again) == blocks
    # A request that needs the whole pool evicts them all, tail first.
    hog = make_request(list(range(100, 132)), "hog")
    prefill(bm, hog)
    assert bm.match_prefix(again) == []
    bm.free(hog)


def test_eviction_takes_the_tail_of_a_prefix_first(bm: BlockManager) -> None:
    first = make_request(list(range(16)), "a")
    prefill(bm, first)
    bm.free(first)
    # 4 truly free blocks + 4 evictable; taking 5 evicts exactly one cached block.
    taker = make_request(list(range(200, 220)), "t")
    prefill(bm, taker)
    again = make_request(list(range(16)) + [1], "b")
    assert len(bm.match_prefix(again)) == 3  # the head survives
    bm.free(taker)


def test_reviving_evictable_blocks_counts_against_free(bm: BlockManager) -> None:
    first = make_request(list(range(16)), "a")
    prefill(bm, first)
    bm.free(first)
    hog = make_request(list(range(100, 116)), "hog")  # the 4 truly free blocks
    prefill(bm, hog)
    again = make_request(list(range(16)) + [1, 2, 3, 4, 5], "b")
    cached = bm.match_prefix(again)
    assert len(cached) == 4
    # 4 revived + 2 fresh > 4 free: refused; 4 revived + 0 fresh fits.
    assert not bm.can_allocate(again, cached, 5)
    assert bm.can_allocate(again, cached, 0)
    bm.free(hog)


def test_identical_prompts_computed_together_keep_one_cache_entry(bm: BlockManager) -> None:
    a = make_request(list(range(9)), "a")
    b = make_request(list(range(9)), "b")
    for request in (a, b):  # both miss: allocated in the same step
        bm.allocate(request, bm.match_prefix(request), request.num_tokens)
    for request in (a, b):
        request.num_computed_tokens = request.num_tokens
        bm.commit(request)
    assert bm.num_cached_blocks == 2
    bm.check_integrity([a, b])
    bm.free(a)
    bm.free(b)


def test_prefix_caching_disabled_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    first = make_request(list(range(10)), "a")
    prefill(bm, first)
    assert bm.match_prefix(make_request(list(range(10)), "b")) == []
    bm.free(first)
    assert bm.num_cached_blocks == 0
    bm.check_integrity()


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    live: list[Request] = []
    for step in range(400):
        if live and rng.random() < 0.3:
            request = live.pop(rng.randrange(len(live)))
            bm.free(request)
        elif rng.random() < 0.5:
            # Prompts from a few shared prefixes, so the cache gets hits.
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            request = make_request(base + [rng.randrange(50) for _ in range(rng.randrange(1, 10))], f"r{step}")
            cached = bm.match_prefix(request)
            num_new = request.num_tokens - len(cached) * BLOCK
            if bm.can_allocate(request, cached, num_new):
                bm.allocate(request, cached, num_new)
                request.num_computed_tokens = request.num_tokens
                bm.commit(request)
                live.append(request)
        elif live:
            request = rng.choice(live)
            request.append_token(rng.randrange(50))
            if bm.can_append(request, 1):
                bm.append_slot(request, 1)
                request.num_computed_tokens += 1
                bm.commit(request)
            else:
                request.token_ids.pop()
        bm.check_integrity(live)
    for request in live:
        bm.free(request)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks
