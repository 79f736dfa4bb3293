"""The client port's edge (issue 15): state changes only on the admin port, the
API key, the body bound, parsing off the loop, and the admission limit, each on
a real worker process.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from disagg.testing.operator_process import sample
from disagg.workers.http.app import AdmittedStream
from disagg.workers.http.edge import MAX_BODY_BYTES, read_body
from disagg.workers.http.errors import BodyTimeout

API_KEY = "sk-test-edge"
COMPLETIONS = "/v1/completions"


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}


def _assert_error(response: httpx.Response, status: int, words: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    error: dict[str, Any] = response.json()["error"]
    # A 401's code is OpenAI's name for it, as is a prompt past the context's.
    assert error["code"] in (("invalid_api_key",) if status == 401 else (status, "context_length_exceeded")), error
    assert words.lower() in error["message"].lower(), error
    return error


# --- the admin port ---------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/drain"), ("DELETE", "/drain"), ("GET", "/drain"),
    ("POST", "/xllm.proto.DisaggPDService/LinkInstance"), ("POST", "/xllm.proto.DisaggPDService/UnlinkInstance"),
])
def test_the_client_port_changes_no_state(served: Any, http: httpx.Client, method: str, path: str) -> None:
    assert http.request(method, path).status_code in (404, 405)
    assert http.get("/ready").status_code == 200, "still serving"
    with httpx.Client(base_url=served.process.admin_url, timeout=10.0) as admin:
        assert admin.get("/drain").json() == {"draining": False, "in_flight": 0}


def test_the_admin_port_drains_and_undrains(served: Any, http: httpx.Client) -> None:
    with httpx.Client(base_url=served.process.admin_url, timeout=10.0) as admin:
        try:
            assert admin.post("/drain").json()["draining"] is True
            assert http.get("/ready").status_code == 503
            assert "disagg_draining 1.0" in admin.get("/metrics").text
        finally:
            assert admin.delete("/drain").json() == {"draining": False, "in_flight": 0}
    assert http.get("/ready").status_code == 200


# --- the body ---------------------------------------------------------------------


def test_an_oversized_body_is_413_before_it_is_read(http: httpx.Client) -> None:
    big = json.dumps(_completion(prompt="x" * (MAX_BODY_BYTES + 1)))
    _assert_error(http.post(COMPLETIONS, content=big, headers={"content-type": "application/json"}), 413, "larger")


def test_an_oversized_chunked_body_is_413(http: httpx.Client) -> None:
    chunk = b"x" * (1024 * 1024)

    def body() -> Iterator[bytes]:  # no Content-Length: the server counts as it reads
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(MAX_BODY_BYTES // len(chunk) + 1):
            yield chunk
        yield b'"}'

    _assert_error(http.post(COMPLETIONS, content=body(), headers={"content-type": "application/json"}), 413, "larger")
    assert http.post(COMPLETIONS, json=_completion()).status_code == 200


async def test_a_body_that_never_comes_is_a_408() -> None:
    """A client that sends headers and then trickles (or holds) its body: cut at one deadline."""
    async def stalled() -> dict[str, Any]:  # the ASGI receive of a body that does not come
        await asyncio.sleep(60)
        return {"type": "http.request", "body": b"", "more_body": False}

    request = Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"10")]}, stalled)
    with pytest.raises(BodyTimeout) as err:
        await read_body(request, timeout_s=0.2)
    assert err.value.status == 408


async def test_a_stream_whose_client_stopped_reading_is_cut_off_and_gives_everything_back() -> None:
    """A client that keeps its connection but reads nothing: once the socket's buffers are full, a
    send waits forever. Each event's send is bounded, and then the slots and the request go."""
    released, ended = asyncio.Event(), asyncio.Event()

    async def events() -> AsyncGenerator[str, None]:
        try:
            while True:
                yield "data: {}\n\n"
        finally:
            ended.set()  # the request's end: the engine frees its blocks here

    async def receive() -> dict[str, Any]:  # the client never disconnects
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:  # the headers go out; the first event never drains
        if message["type"] == "http.response.body":
            await asyncio.sleep(60)

    stream = AdmittedStream(events(), released.set, send_timeout_s=0.2)
    await asyncio.wait_for(stream({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 5)
    assert released.is_set() and ended.is_set()


def test_a_large_body_does_not_stall_the_loop(served: Any, http: httpx.Client) -> None:
    """A prompt of megabytes takes seconds to parse and tokenise; /health answers meanwhile."""
    big = json.dumps(_completion(prompt="Hello world! How are you today? " * 100_000))  # 3.2 MB
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http.post, COMPLETIONS, content=big, headers={"content-type": "application/json"})
        latencies = []
        while not answer.done():
            began = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - began)
            time.sleep(0.05)
        _assert_error(answer.result(), 400, "context")
    assert latencies and max(latencies) < 1.0, f"/health waited {max(latencies):.2f} s behind a large body"


# --- the API key and the admission limit --------------------------------------------


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            worker_launcher: Callable[..., contextlib.AbstractContextManager[Any]]) -> Iterator[Any]:
    """A worker with an API key (from the environment, as a Secret gives it) that holds
    at most 2 requests: one running, one queued."""
    log = tmp_path_factory.mktemp("guarded") / "worker.log"
    with worker_launcher(str(tiny_model_dir), log, "--max-num-seqs", "1", "--max-queued-requests", "1",
                         env={"DISAGG_API_KEY": API_KEY}) as worker:
        yield worker


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {API_KEY}", "Bearer"])
def test_the_client_api_needs_the_key(guarded: Any, header: str | None) -> None:
    headers = {"authorization": header} if header else {}
    with httpx.Client(base_url=guarded.base_url, timeout=30.0, headers=headers) as client:
        _assert_error(client.post(COMPLETIONS, json=_completion()), 401, "API key")
        _assert_error(client.get("/v1/models"), 401, "API key")
        # OpenAI's body for a bad key: the 401 keeps its status, the type and code are OpenAI's.
        error = client.post(COMPLETIONS, json=_completion()).json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        # Probes and scrapes stay open.
        for path in ("/health", "/ready", "/metrics"):
            assert client.get(path).status_code == 200, path


def test_the_key_lets_a_client_in(guarded: Any) -> None:
    with httpx.Client(base_url=guarded.base_url, timeout=30.0, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"
        assert c.post(COMPLETIONS, json=_completion()).json()["choices"][0]["finish_reason"] == "length"


def test_a_request_that_can_never_be_admitted_is_400_not_429(guarded: Any) -> None:
    """A 429 has the client retry; n choices past the whole limit (2 here) would never fit, even idle."""
    with httpx.Client(base_url=guarded.base_url, timeout=60.0, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        error = _assert_error(c.post(COMPLETIONS, json=_completion(n=3)), 400, "at most 2 at once")
        assert error["param"] == "n"
        error = _assert_error(c.post(COMPLETIONS, json=_completion(prompt=["a", "b", "c"])), 400, "3 prompt(s)")
        assert error["param"] == "prompt"
        assert c.post(COMPLETIONS, json=_completion(n=2)).status_code == 200  # the limit itself fits


def _metric(worker: Any, name: str, **labels: str) -> float:
    return sample(httpx.get(f"{worker.base_url}/metrics", timeout=10.0).text, name, labels)


def test_refusals_before_the_engine_are_counted(guarded: Any) -> None:
    """A body too large is a rejected request; a wrong API key an auth failure on path api-key."""
    rejected = _metric(guarded, "disagg_requests_total", role="mixed", status="rejected")
    failures = _metric(guarded, "disagg_auth_failures_total", path="api-key")
    big = json.dumps(_completion(prompt="x" * (MAX_BODY_BYTES + 1)))
    with httpx.Client(base_url=guarded.base_url, timeout=60.0) as client:
        refused = client.post(COMPLETIONS, content=big, headers={"authorization": f"Bearer {API_KEY}",
                                                                 "content-type": "application/json"})
        assert refused.status_code == 413
        assert client.post(COMPLETIONS, json=_completion(), headers={"authorization": "Bearer no"}).status_code == 401
    assert _metric(guarded, "disagg_requests_total", role="mixed", status="rejected") == rejected + 1
    assert _metric(guarded, "disagg_auth_failures_total", path="api-key") == failures + 1
    # One request held of 2: an n=2 request passes the first look, then does not fit.
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=guarded.base_url, timeout=60.0, headers=headers) as client:
        long = _completion(max_tokens=400, ignore_eos=True, stream=True)
        with client.stream("POST", COMPLETIONS, json=long) as held:
            assert held.status_code == 200
            _assert_error(client.post(COMPLETIONS, json=_completion(n=2)), 429, "limit")
    assert _metric(guarded, "disagg_requests_total", role="mixed", status="rejected") == rejected + 2


def test_beyond_the_admission_limit_is_429_with_retry_after(guarded: Any) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    rejected = _metric(guarded, "disagg_requests_total", role="mixed", status="rejected")
    long = _completion(max_tokens=400, ignore_eos=True, stream=True)
    with httpx.Client(base_url=guarded.base_url, timeout=60.0, headers=headers) as client:
        with contextlib.ExitStack() as streams:
            for _ in range(2):  # one running, one queued: the limit
                response = streams.enter_context(client.stream("POST", COMPLETIONS, json=long))
                assert response.status_code == 200
            refused = client.post(COMPLETIONS, json=_completion())
            _assert_error(refused, 429, "limit")
            assert refused.headers["retry-after"] == "1"
            assert _metric(guarded, "disagg_requests_total", role="mixed", status="rejected") == rejected + 1
        # Closing the streams gives their places back.
        deadline = time.monotonic() + 30
        while (ok := client.post(COMPLETIONS, json=_completion())).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ok.status_code == 200, ok.text
