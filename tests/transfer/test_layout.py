"""KVLayout, block runs and the transfer handle: pure logic."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from disagg.workers.transfer import TRANSPORTS, KVLayout, TransferError, TransferHandle, TransferTimeout
from disagg.workers.transfer.base import BlockRun, PendingTransfers, check_runs, merge_runs, split_runs

LAYOUT = KVLayout("m", "bfloat16", num_layers=2, num_blocks=10, block_size=16, num_kv_heads=4, head_dim=64)


def test_layout_sizes_match_the_pool_tensor() -> None:
    pool = torch.zeros(LAYOUT.shape, dtype=torch.bfloat16)
    assert LAYOUT.block_bytes == 2 * 16 * 4 * 64 * 2
    assert LAYOUT.pool_bytes == pool.numel() * pool.element_size()
    assert KVLayout.of_pool(pool, "m") == LAYOUT
    # (layer 1, block 3) starts where the tensor element pool[1, 3] starts.
    assert LAYOUT.block_offset(1, 3) == (pool[1, 3].data_ptr() - pool.data_ptr())


def test_mismatch_reason_names_every_differing_field_but_not_num_blocks() -> None:
    other = KVLayout("other", "bfloat16", 2, 99, 32, 4, 64)
    reason = LAYOUT.mismatch_reason(other)
    assert reason is not None and "model" in reason and "block_size" in reason
    assert "num_blocks" not in reason
    assert LAYOUT.mismatch_reason(KVLayout("m", "bfloat16", 2, 3, 16, 4, 64)) is None


@pytest.mark.parametrize("bad", [{"dtype": "float17"}, {"num_layers": 0}, {"model": ""}, {"head_dim": True}])
def test_layout_rejects_bad_fields(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        KVLayout.from_dict({**LAYOUT.to_dict(), **bad})


def test_layout_rejects_wrong_pools() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        KVLayout.of_pool(torch.zeros(2, 10, 2, 16, 4, 64).transpose(0, 1), "m")
    with pytest.raises(ValueError, match="does not match"):
        LAYOUT.check_pool(torch.zeros(LAYOUT.shape, dtype=torch.float16))


def test_merge_runs_joins_blocks_consecutive_on_both_sides() -> None:
    assert merge_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [BlockRun(4, 0, 3), BlockRun(9, 3, 1), BlockRun(10, 7, 1)]
    assert merge_runs([], []) == []
    with pytest.raises(ValueError, match="destination"):
        merge_runs([1, 2], [3])


def test_split_runs_balances_blocks_and_keeps_every_pair() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 40)
        src, dst = rng.sample(range(100), n), rng.sample(range(100), n)
        src[: n // 2] = sorted(src[: n // 2])  # some long runs too
        runs = merge_runs(src, dst)
        parts = rng.randint(1, 6)
        groups = split_runs(runs, parts)
        sizes = [sum(r.count for r in group) for group in groups]
        assert len(groups) == min(parts, n) and max(sizes) - min(sizes) <= 1
        pairs = {(r.src + i, r.dst + i) for group in groups for r in group for i in range(r.count)}
        assert pairs == set(zip(src, dst))


def test_check_runs_bounds_each_side() -> None:
    check_runs([BlockRun(0, 8, 2)], src_blocks=2, dst_blocks=10)
    with pytest.raises(ValueError, match="destination blocks 8..10"):
        check_runs([BlockRun(0, 8, 3)], src_blocks=3, dst_blocks=10)


def test_handle_completes_after_all_parts_and_fails_on_first_error() -> None:
    handle = TransferHandle(parts=2, nbytes=10)
    handle.part_done()
    with pytest.raises(TransferTimeout):
        handle.wait(0.01)
    threading.Thread(target=handle.part_done).start()
    handle.wait(5.0)
    failed = TransferHandle(parts=3, nbytes=10)
    failed.part_done("boom")
    with pytest.raises(TransferError, match="boom"):
        failed.wait(1.0)
    TransferHandle(parts=0, nbytes=0).wait(0.0)


def test_registry_names_the_transports() -> None:
    assert "tcp" in TRANSPORTS and all(cls.name == name for name, cls in TRANSPORTS.items())


def test_pending_transfers_report_a_failure_once_even_after_later_transfers() -> None:
    pending = PendingTransfers()
    failed = TransferHandle(parts=1, nbytes=1)
    failed.part_done("peer went away")
    pending.add(failed)
    ok = TransferHandle(parts=0, nbytes=0)
    pending.add(ok)  # adding prunes successes only
    with pytest.raises(TransferError, match="peer went away"):
        pending.wait_all(1.0, "peer")
    pending.wait_all(1.0, "peer")  # reported once, then forgotten
    slow = TransferHandle(parts=1, nbytes=1)
    pending.add(slow)
    with pytest.raises(TransferTimeout, match="not done"):
        pending.wait_all(0.05, "peer")
