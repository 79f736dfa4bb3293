"""`merge_streams`: the pump-into-a-queue pattern of the HTTP fan-out and the decode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from disagg.workers.streams import merge_streams


async def counting(n: int, delay: float = 0.0) -> AsyncIterator[int]:
    for i in range(n):
        await asyncio.sleep(delay)
        yield i


async def test_every_item_arrives_once_in_source_order() -> None:
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    async with aclosing(merge_streams([counting(5), counting(0), counting(3, 0.001)])) as merged:
        async for batch in merged:
            assert batch, "no empty batch"
            for index, item in batch:
                got[index].append(item)
    assert got == {0: [0, 1, 2, 3, 4], 1: [], 2: [0, 1, 2]}


async def test_a_slow_consumer_gets_what_arrived_in_one_batch() -> None:
    go_on = asyncio.Event()

    async def source() -> AsyncIterator[int]:
        yield 0
        await go_on.wait()
        for i in (1, 2, 3):
            await asyncio.sleep(0)
            yield i

    async with aclosing(merge_streams([source()])) as merged:
        assert await anext(merged) == [(0, 0)]
        go_on.set()
        await asyncio.sleep(0.05)  # the rest arrives meanwhile
        assert await anext(merged) == [(0, 1), (0, 2), (0, 3)]


async def test_a_failing_source_raises_after_its_items_and_cancels_the_others() -> None:
    cancelled = asyncio.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            await asyncio.sleep(60)
            yield 0
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def failing() -> AsyncIterator[int]:
        yield 7
        raise KeyError("boom")

    seen: list[tuple[int, int]] = []
    with pytest.raises(KeyError, match="boom"):
        async with aclosing(merge_streams([endless(), failing()])) as merged:
            async for batch in merged:
                seen += batch
    assert seen == [(1, 7)] and cancelled.is_set()
