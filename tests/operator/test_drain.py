"""drain.py against a stand-in worker HTTP server that speaks the worker's drain contract
(`POST /drain`, in-flight requests in /metrics)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from disagg.operator.drain import drain, in_flight
from disagg.workers.security.control import HTTP_HEADER
from disagg.workers.security.key import AuthError, ClusterKey, CredentialVerifier
from disagg.operator.links import Endpoint


class StandInWorker(ThreadingHTTPServer):
    """In flight: `busy` requests; after POST /drain each /metrics read finishes one (if `finishing`)."""

    def __init__(self, busy: int, finishing: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.busy, self.finishing = busy, finishing
        self.drain_calls: list[float] = []
        self.credentials: list[str | None] = []  # each POST /drain's X-Disagg-Auth
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: StandInWorker

    def log_message(self, *_: Any) -> None:
        return None

    def _answer(self, body: str) -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        assert self.path == "/drain", self.path
        with self.server.lock:
            self.server.drain_calls.append(time.monotonic())
            self.server.credentials.append(self.headers.get(HTTP_HEADER))
        self._answer('{"draining": true}')

    def do_GET(self) -> None:  # noqa: N802
        assert self.path == "/metrics", self.path
        with self.server.lock:
            busy = self.server.busy
            if self.server.drain_calls and self.server.finishing and busy:
                self.server.busy -= 1
        self._answer("# TYPE disagg_requests_running gauge\n"
                     f"disagg_requests_running {busy}\n"
                     "# TYPE disagg_requests_waiting gauge\n"
                     "disagg_requests_waiting 0\n")


@pytest.fixture
def worker(request: pytest.FixtureRequest) -> Iterator[StandInWorker]:
    busy, finishing = request.param
    server = StandInWorker(busy, finishing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _endpoint(server: StandInWorker) -> tuple[Endpoint, int]:
    return Endpoint(pod="p", incarnation="u/0", ip="127.0.0.1"), server.server_address[1]


@pytest.mark.parametrize("worker", [(3, True)], indirect=True)
async def test_drain_stops_new_work_after_the_grace_and_waits_until_idle(worker: StandInWorker) -> None:
    pod, port = _endpoint(worker)
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=2.0) as http:
        assert await in_flight(http, pod.ip, port) == 3
        outcome = await drain(pod, http, deadline=time.time() + 30, grace_s=0.3, poll_s=0.01, port=port)
        assert await in_flight(http, pod.ip, port) == 0
    assert outcome.idle and outcome.stopped
    assert len(worker.drain_calls) == 1 and worker.drain_calls[0] - began >= 0.3


@pytest.mark.parametrize("worker", [(0, True)], indirect=True)
async def test_drain_is_signed_with_the_cluster_key_for_its_verb_and_path(worker: StandInWorker) -> None:
    pod, port = _endpoint(worker)
    key = ClusterKey.generate()
    async with httpx.AsyncClient(timeout=2.0) as http:
        await drain(pod, http, deadline=time.time() + 5, grace_s=0.0, poll_s=0.01, port=port, key=key)
        await drain(pod, http, deadline=time.time() + 5, grace_s=0.0, poll_s=0.01, port=port)  # --insecure workers
    signed, unsigned = worker.credentials
    assert unsigned is None and signed is not None
    CredentialVerifier(key).verify("POST /drain", signed)  # what the worker's admin port checks
    with pytest.raises(AuthError):
        CredentialVerifier(key).verify("DELETE /drain", signed)


@pytest.mark.parametrize("worker", [(2, False)], indirect=True)
async def test_drain_gives_up_at_the_deadline(worker: StandInWorker) -> None:
    pod, port = _endpoint(worker)
    async with httpx.AsyncClient(timeout=2.0) as http:
        outcome = await drain(pod, http, deadline=time.time() + 0.5, grace_s=0.0, poll_s=0.05, port=port)
    assert not outcome.idle and outcome.stopped and worker.busy == 2


async def test_an_unreachable_worker_counts_as_idle() -> None:
    pod = Endpoint(pod="p", incarnation="u/0", ip="127.0.0.1")
    async with httpx.AsyncClient(timeout=1.0) as http:
        outcome = await drain(pod, http, deadline=time.time() + 5, grace_s=0.0, poll_s=0.05, port=1)
    assert outcome.idle and not outcome.stopped
