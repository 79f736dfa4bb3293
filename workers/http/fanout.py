"""Runs the `n` choices of each prompt of one API request as backend sequences.

The engine runs one sequence per request, so choice `i` of request `R` is the
backend request `R-i`: with a batch of prompts (/v1/completions), choice j of
prompt p has index `i = p * n + j` (OpenAI's and vLLM's numbering) and seed
`seed + j` (distinct but reproducible samples, the same whatever the batch). Their outputs are merged into one stream. Whatever ends the stream
early (the client went away, an error, the consumer stopped reading) aborts
every choice that has not finished, so no KV blocks stay held.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing

from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.http.backend import Backend
from disagg.workers.streams import merge_streams


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
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    wait_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield (choice index, delta) until every choice of every prompt has finished.

    Args:
        wait_disconnect: returns when the client has gone away; the stream
            then raises ClientDisconnected (after aborting the choices).
    Use it with `contextlib.aclosing`, so that the aborts run as soon as the
    consumer stops.
    """
    n = params.n * len(prompts)
    ids = [choice_request_id(request_id, i) for i in range(n)]

    async def choice(i: int) -> AsyncIterator[RequestOutput]:
        finished = False
        prompt, j = divmod(i, params.n)
        async for out in backend.generate(ids[i], prompts[prompt], choice_params(params, j)):
            finished = out.finished
            yield out
        if not finished:
            raise RuntimeError(f"request {ids[i]} ended without a finished output")

    async def disconnected() -> AsyncIterator[RequestOutput]:
        assert wait_disconnect is not None
        await wait_disconnect()
        raise ClientDisconnected()
        yield  # an async generator that only raises

    sources = [choice(i) for i in range(n)] + ([disconnected()] if wait_disconnect is not None else [])
    finished: set[int] = set()
    try:
        async with aclosing(merge_streams(sources)) as merged:
            async for batch in merged:
                for i, out in batch:
                    if out.finished:
                        finished.add(i)
                    yield i, out
                if len(finished) == n:
                    break  # the disconnect watcher never ends by itself
    finally:
        # NOTE: aborts must run even when this generator is being cancelled,
        # so they are shielded from a second cancellation.
        await asyncio.shield(_abort_all(backend, [ids[i] for i in range(n) if i not in finished]))


async def _abort_all(backend: Backend, request_ids: list[str]) -> None:
    for rid in request_ids:
        await backend.abort(rid)
