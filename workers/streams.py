"""Merging async streams: each source runs in its own task, and the consumer
takes what has arrived, in arrival order, in batches (the HTTP fan-out of `n`
choices; a decode batching its tokens for one Generations call)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Item(Generic[T]):
    index: int
    value: T


@dataclass(frozen=True)
class _Failed:
    error: Exception


_END = object()  # a source ended


async def merge_streams(sources: Sequence[AsyncIterable[T]]) -> AsyncGenerator[list[tuple[int, T]], None]:
    """Yield batches of (source index, item): everything that arrived since the
    previous batch, in arrival order (a slow consumer gets fewer, larger batches).

    Ends once every source has ended; a source's exception is raised here after
    the items that came before it. Closing the generator (use it with
    `contextlib.aclosing`) cancels the sources still running and waits for them.
    """
    queue: asyncio.Queue[_Item[T] | _Failed | object] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterable[T]) -> None:
        try:
            async for value in source:
                queue.put_nowait(_Item(index, value))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(_Failed(exc))
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    running = len(tasks)
    try:
        while running:
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            batch: list[tuple[int, T]] = []
            for entry in arrived:
                if isinstance(entry, _Failed):
                    if batch:
                        yield batch
                    raise entry.error
                if isinstance(entry, _Item):
                    batch.append((entry.index, entry.value))
                else:
                    running -= 1
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
