"""The operator's calls to its workers end within one bound, however slowly a worker answers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from disagg.operator.http_client import BoundedClient


async def test_a_worker_trickling_its_answer_is_cut_at_the_whole_calls_bound() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):  # each byte well within a read timeout, the whole far beyond the bound
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with BoundedClient(0.5) as http:
            began = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await http.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0)
            assert time.monotonic() - began < 2.0
    finally:
        server.close()
