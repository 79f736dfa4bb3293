"""The operator's HTTP client to its workers (health, metrics, drain), with a bound on each
whole exchange: httpx's timeouts bound each read, so a worker that trickles its answer a
byte at a time would otherwise stall the reconcile pass for as long as it likes."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class BoundedClient(httpx.AsyncClient):
    """An AsyncClient whose every request, answer included, ends within `total_s` seconds
    (httpx.ReadTimeout after that, an httpx.HTTPError as its callers expect)."""

    def __init__(self, total_s: float, **kwargs: Any) -> None:
        super().__init__(timeout=httpx.Timeout(total_s), **kwargs)
        self._total_s = total_s

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        try:
            async with asyncio.timeout(self._total_s):
                return await super().send(request, **kwargs)
        except TimeoutError:
            raise httpx.ReadTimeout(f"no whole answer within {self._total_s:.0f} s", request=request) from None
