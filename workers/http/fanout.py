"""Runs the `n` choices of one API request as `n` backend sequences.

The engine runs one sequence per request, so choice `i` of request `R` is the
backend request `R-i`, with seed `seed + i` (distinct but reproducible
samples). Their outputs are merged into one stream. Whatever ends the stream
early (the client went away, an error, the consumer stopped reading) aborts
every choice that has not finished, so no KV blocks stay held.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.http.backend import Backend


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the request finished."""


def choice_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


async def stream_choices(
    backend: Backend,
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    wait_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield (choice index, delta) until every choice has finished.

    Args:
        wait_disconnect: returns when the client has gone away; the stream
            then raises ClientDisconnected (after aborting the choices).
    Use it with `contextlib.aclosing`, so that the aborts run as soon as the
    consumer stops.
    """
    n = params.n
    ids = [choice_request_id(request_id, i) for i in range(n)]
    # (index, output) per delta; (index, None) when a choice's stream ends;
    # (-1, exc) when a pump or the disconnect watcher fails the whole stream.
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in backend.generate(ids[i], prompt_token_ids, choice_params(params, i)):
                queue.put_nowait((i, out))
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((-1, exc))
        finally:
            queue.put_nowait((i, None))

    async def watch() -> None:
        assert wait_disconnect is not None
        await wait_disconnect()
        queue.put_nowait((-1, ClientDisconnected()))

    tasks = [asyncio.create_task(pump(i)) for i in range(n)]
    if wait_disconnect is not None:
        tasks.append(asyncio.create_task(watch()))
    finished: set[int] = set()
    ended = 0
    try:
        while ended < n:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                ended += 1
                if i not in finished:
                    raise RuntimeError(f"request {ids[i]} ended without a finished output")
                continue
            if item.finished:
                finished.add(i)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        # NOTE: aborts must run even when this generator is being cancelled,
        # so they are shielded from a second cancellation.
        await asyncio.shield(_abort_all(backend, [ids[i] for i in range(n) if i not in finished], tasks))


async def _abort_all(backend: Backend, request_ids: list[str], tasks: list[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    for rid in request_ids:
        await backend.abort(rid)
