"""Asking a worker whether its model is loaded (GET /health), before linking it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from disagg.operator.health import model_loaded
from disagg.workers.local import free_port
from disagg.workers.http.app import AppState, build_app
from disagg.workers.metrics import WorkerMetrics

Asgi = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[dict[str, Any]], Awaitable[None]]],
                Awaitable[None]]


def answering(status: int, body: bytes) -> Asgi:
    """An ASGI app that answers every request with `status` and `body`: how other servers might answer."""
    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                  send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


def ask(app: Any) -> bool:
    async def run() -> bool:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            return await model_loaded(http, "127.0.0.1")
    return asyncio.run(run())


def test_a_worker_still_loading_its_model_is_not_loaded() -> None:
    # The real worker app, as it serves before its model has loaded.
    assert not ask(build_app(AppState(WorkerMetrics("prefill"))))


@pytest.mark.parametrize("status, body, loaded", [
    (200, json.dumps({"status": "ok", "loaded": True}).encode(), True),
    (200, json.dumps({"status": "ok", "loaded": False}).encode(), False),
    (200, json.dumps({"status": "ok"}).encode(), False),  # says nothing about the model
    (200, json.dumps({"status": "ok", "loaded": "yes"}).encode(), False),
    (200, b"[true]", False),
    (200, b"ok", False),  # not JSON
    (503, json.dumps({"loaded": True}).encode(), False),
])
def test_only_an_explicit_loaded_true_counts(status: int, body: bytes, loaded: bool) -> None:
    assert ask(answering(status, body)) is loaded


def test_a_worker_that_does_not_answer_is_not_loaded() -> None:
    async def run() -> bool:
        async with httpx.AsyncClient() as http:
            return await model_loaded(http, "127.0.0.1", port=free_port(), timeout_s=2.0)
    assert not asyncio.run(run())
