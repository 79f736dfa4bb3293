"""Before a backend is attached (the model is loading) the app is alive but not
ready, and generation endpoints answer 503 in OpenAI's shape."""

from __future__ import annotations

import httpx
import pytest

from disagg.workers.http.app import AppState, build_app
from disagg.workers.metrics import WorkerMetrics


@pytest.fixture
async def client() -> httpx.AsyncClient:
    app = build_app(AppState(WorkerMetrics("mixed")))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


async def test_alive_but_not_ready(client: httpx.AsyncClient) -> None:
    async with client:
        assert (await client.get("/health")).status_code == 200
        assert [(await client.head(path)).status_code for path in ("/health", "/ready")] == [200, 503]
        ready = await client.get("/ready")
        assert ready.status_code == 503
        assert "loading" in ready.json()["error"]["message"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        chat = await client.post("/v1/chat/completions", json=body)
        assert chat.status_code == 503
        assert chat.json()["error"]["type"] == "service_unavailable"
        assert (await client.get("/v1/models")).status_code == 503  # loading: nothing to list yet


async def test_metrics_served_while_loading(client: httpx.AsyncClient) -> None:
    async with client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'disagg_requests_total{role="mixed",status="ok"} 0.0' in response.text
