"""Real `disagg serve` processes on loopback: prefill + decode outputs equal the
mixed role's through the `openai` client; links through `disagg link`;
readiness, drain and faults (unlink, a killed decode, a killed prefill).

One set of workers serves the whole module (starting processes is the slow
part on a small machine): prefill A (PUSH) and prefill B (PULL), each linked
to decodes D1 and D2, and a mixed worker M as the reference.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from disagg.proto.vocabulary import TRANSFER_PORT
from disagg.testing.operator_process import sample
from disagg.workers.local import WorkerProcess, link, unlink
from disagg.workers.security.control import http_credential_headers

BLOCK_SIZE = 4  # PROCESS_ENGINE_ARGS in conftest.py
MODEL = "tiny"  # its served model name
# Lengths around the block size: one token, a block minus one, exact blocks, one past.
PROMPT_LENGTHS = (1, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33)
LONG = 400  # output tokens of a request that is still running when a fault hits
FAULT_BOUND_S = 30.0  # an affected request ends within this


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt + n) % 300 + 3 for i in range(n)]


@dataclass
class Cluster:
    push: WorkerProcess  # prefill A
    pull: WorkerProcess  # prefill B
    d1: WorkerProcess
    d2: WorkerProcess
    mixed: WorkerProcess

    @property
    def prefills(self) -> list[WorkerProcess]:
        return [self.push, self.pull]

    @property
    def decodes(self) -> list[WorkerProcess]:
        return [self.d1, self.d2]


@pytest.fixture(scope="module")
def cluster(processes: Any) -> Cluster:
    d1, d2, push, pull, mixed = processes.start(
        ("decode",), ("decode",), ("prefill", "--kv-transfer-mode", "PUSH"), ("prefill", "--kv-transfer-mode", "PULL"),
        ("mixed",),
    )
    for d in (d1, d2):
        for p in (push, pull):
            assert link(d, p) is None
    for p in (push, pull):
        processes.wait_until(lambda: _ready(p) == 200, f"prefill {p.instance_name} is ready")
    return Cluster(push, pull, d1, d2, mixed)


def _ready(worker: WorkerProcess) -> int:
    return httpx.get(f"{worker.base_url}/ready", timeout=10.0).status_code


def client_of(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="unused", timeout=120.0, max_retries=0)


def complete(worker: WorkerProcess, prompt: list[int], max_tokens: int = 12, stream: bool = False) -> list[int]:
    """Greedy token ids of one completion, through the openai client."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    client = client_of(worker)
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body=extra)
        return list(getattr(r.choices[0], "token_ids"))
    tokens: list[int] = []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body=extra):
        for choice in chunk.choices:
            tokens += getattr(choice, "token_ids", None) or []
    return tokens


def free_blocks(worker: WorkerProcess) -> float:
    return worker.metric("disagg_kv_blocks_free")


# --- outputs -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
def test_greedy_outputs_equal_the_mixed_role(cluster: Cluster, mode: str, stream: bool) -> None:
    prefill = cluster.push if mode == "PUSH" else cluster.pull
    for n in PROMPT_LENGTHS:
        expected = complete(cluster.mixed, prompt_of(n))
        assert len(expected) == 12
        assert complete(prefill, prompt_of(n), stream=stream) == expected, f"prompt of {n} tokens"
    sent = prefill.metric("disagg_kv_transfer_bytes_total", direction="sent")
    assert sent > 0, "the KV went over the data path"


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
def test_client_fields_through_pd_equal_the_mixed_role(cluster: Cluster, mode: str) -> None:
    """Echo with prompt logprobs (lm-eval's loglikelihood request), a batch of prompts with n,
    logit_bias and min_tokens: a prefill's answer is the mixed worker's (issue 16 item 4)."""
    prefill = cluster.push if mode == "PUSH" else cluster.pull
    requests: list[dict[str, Any]] = [
        {"prompt": prompt_of(9), "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": prompt_of(9), "max_tokens": 1, "echo": True, "logprobs": 2, "prompt_logprobs": 1},
        {"prompt": [prompt_of(5), prompt_of(17, 1)], "n": 2, "max_tokens": 6, "ignore_eos": True},
        {"prompt": prompt_of(8), "max_tokens": 6, "logit_bias": {"77": 100}, "ignore_eos": True},
        {"prompt": prompt_of(8), "max_tokens": 6, "min_tokens": 3, "logit_bias": {"1": 100}},
    ]
    for body in requests:
        body = {"model": MODEL, "temperature": 0, "return_token_ids": True, **body}
        want = httpx.post(f"{cluster.mixed.base_url}/v1/completions", json=body, timeout=120.0).json()
        got = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=120.0).json()
        assert "choices" in got and "choices" in want, (body, got, want)
        assert [c["index"] for c in got["choices"]] == [c["index"] for c in want["choices"]], body
        for mine, theirs in zip(got["choices"], want["choices"]):
            assert (mine["text"], mine["token_ids"], mine["finish_reason"]) == \
                (theirs["text"], theirs["token_ids"], theirs["finish_reason"]), body
            if theirs["logprobs"] is not None:
                assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
                assert mine["logprobs"]["token_logprobs"][0] is None
                assert mine["logprobs"]["token_logprobs"][1:] == pytest.approx(theirs["logprobs"]["token_logprobs"][1:],
                                                                               abs=1e-4)
            assert (mine["prompt_logprobs"] is None) == (theirs["prompt_logprobs"] is None)
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
def test_a_response_through_pd_equals_the_mixed_roles(cluster: Cluster, mode: str) -> None:
    """OpenAI's Responses API on a prefill: whole and streamed, the mixed worker's text."""
    prefill = cluster.push if mode == "PUSH" else cluster.pull
    body: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "input": "Tell me a story.",
                            "max_output_tokens": 12, "temperature": 0}
    want = client_of(cluster.mixed).responses.create(**body)
    got = client_of(prefill).responses.create(**body)
    assert got.output_text == want.output_text and got.status == want.status
    assert got.usage is not None and want.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.input_tokens, want.usage.output_tokens)
    with client_of(prefill).responses.create(stream=True, **body) as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == want.output_text


def test_two_prefills_two_decodes_under_concurrent_load(cluster: Cluster) -> None:
    prompts = [prompt_of(n, salt=s) for s in (1, 2) for n in PROMPT_LENGTHS]
    received = [d.metric("disagg_kv_transfer_bytes_total", direction="received") for d in cluster.decodes]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda p: complete(cluster.mixed, p, 16), prompts))
        got = list(pool.map(lambda ip: complete(cluster.prefills[ip[0] % 2], ip[1], 16, stream=ip[0] % 3 == 0),
                            enumerate(prompts)))
    assert got == expected
    after = [d.metric("disagg_kv_transfer_bytes_total", direction="received") for d in cluster.decodes]
    assert all(a > b for a, b in zip(after, received)), "both decodes took requests"


def test_a_decode_refuses_chat_from_clients(cluster: Cluster) -> None:
    r = httpx.post(f"{cluster.d1.base_url}/v1/chat/completions", timeout=10.0,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert "decode instance" in r.json()["error"]["message"]
    # vLLM's /tokenize is a client route too: on the prefill, not on a decode.
    tokenize = {"model": MODEL, "prompt": "hi"}
    assert httpx.post(f"{cluster.d1.base_url}/tokenize", json=tokenize, timeout=10.0).status_code == 404
    assert httpx.post(f"{cluster.prefills[0].base_url}/tokenize", json=tokenize, timeout=10.0).json()["count"] > 0
    response = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    assert httpx.post(f"{cluster.d1.base_url}/v1/responses", json=response, timeout=10.0).status_code == 404


# --- links and readiness ---------------------------------------------------------


@pytest.fixture(scope="module")
def lone_prefill(processes: Any) -> WorkerProcess:
    """A prefill with a different block size, linked to nothing."""
    [p] = processes.start(("prefill", "--block-size", "8"))
    return p


def test_a_prefill_with_no_decode_answers_503(lone_prefill: WorkerProcess) -> None:
    assert _ready(lone_prefill) == 503
    with pytest.raises(openai.APIStatusError) as info:
        complete(lone_prefill, prompt_of(5))
    assert info.value.status_code == 503
    assert "no decode" in str(info.value)
    # What it serves is known before it is linked, as a router discovering models asks.
    [listed] = client_of(lone_prefill).models.list().data
    assert client_of(lone_prefill).models.retrieve(listed.id).id == listed.id


def test_a_prompt_no_decode_can_hold_is_a_413_that_counts_no_tokens(processes: Any) -> None:
    """Refused once the request had started (the router knows the decodes' pools): counted as
    rejected, with no prompt tokens and no latency, as its usage reports none."""
    small, prefill = processes.start(("decode", "--num-kv-blocks", "8"), ("prefill",))
    assert link(small, prefill) is None
    processes.wait_until(lambda: _ready(prefill) == 200, "the prefill is linked")

    def metric(name: str, **labels: str) -> float:
        return sample(httpx.get(f"{prefill.base_url}/metrics", timeout=10).text, name, labels)

    counted = ("disagg_prompt_tokens_total", "disagg_e2e_request_latency_seconds_count",
               "disagg_time_to_first_token_seconds_count")
    before = {name: metric(name) for name in counted}
    rejected = metric("disagg_requests_total", role="prefill", status="rejected")
    with pytest.raises(openai.APIStatusError) as err:
        complete(prefill, prompt_of(200))
    assert err.value.status_code == 413 and "can never fit" in str(err.value)
    assert {name: metric(name) for name in counted} == before
    assert metric("disagg_requests_total", role="prefill", status="rejected") == rejected + 1


def test_disagg_link_refuses_a_different_block_size(cluster: Cluster, lone_prefill: WorkerProcess) -> None:
    """The prefill given by host name and gRPC port only (its transfer port, not the default, is
    asked of it): the refusal comes from the decode, which reached it."""
    assert lone_prefill.instance_name.startswith("127.0.0.1:") and lone_prefill.transfer_port != TRANSFER_PORT
    result = subprocess.run(
        [sys.executable, "-m", "disagg.workers", "link", "--decode", cluster.d1.instance_name,
         "--prefill", lone_prefill.instance_name.replace("127.0.0.1", "localhost"),
         "--cluster-key-file", str(cluster.d1.key_file)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "block_size" in result.stderr and "mismatch" in result.stderr, result.stderr
    assert _ready(lone_prefill) == 503, "a refused link leaves the prefill unlinked"


@pytest.mark.parametrize("port", ["http", "admin"])
def test_the_http_link_form_links_and_unlinks(cluster: Cluster, port: str) -> None:
    """xLLM's JSON form on the decode's HTTP port (DESIGN.md) and its admin port, with the same
    semantics as the gRPC call, signed as the gRPC call is."""
    url = cluster.d2.base_url if port == "http" else cluster.d2.admin_url
    body = {"instance_name": cluster.push.instance_name, "addrs": [cluster.push.transfer_address]}
    before = cluster.d2.metric("disagg_links")
    path = "/xllm.proto.DisaggPDService/LinkInstance"

    def signed() -> dict[str, str]:
        return http_credential_headers(cluster.d2.cluster_key, path)

    assert httpx.post(f"{url}{path}", json=body, timeout=30.0).status_code == 401, "unsigned"
    r = httpx.post(f"{url}{path}", json=body, headers=signed(), timeout=30.0)
    assert r.status_code == 200 and r.json() == {"ok": True}, "linking again is a no-op"
    assert cluster.d2.metric("disagg_links") == before
    bad = httpx.post(f"{url}{path}", json={"addrs": []}, headers=signed(), timeout=30.0)
    assert bad.status_code == 400 and "instance_name" in bad.json()["error"]["message"]


# --- drain -------------------------------------------------------------------


def test_draining_a_decode_sends_new_requests_to_the_other(cluster: Cluster) -> None:
    d1, d2 = cluster.decodes
    refused = d2.metric("disagg_auth_failures_total", path="http-admin")
    unsigned = httpx.post(f"{d2.admin_url}/drain", timeout=10.0)
    assert unsigned.status_code == 401 and d2.metric("disagg_auth_failures_total", path="http-admin") == refused + 1
    assert _ready(d2) == 200, "an unsigned drain changes nothing"
    r = d2.set_draining(True)
    try:
        assert r.status_code == 200 and r.json()["draining"] is True
        assert d2.metric("disagg_draining") == 1
        assert _ready(d2) == 503
        received = d2.metric("disagg_kv_transfer_bytes_total", direction="received")
        for n in (5, 9, 17):
            assert complete(cluster.push, prompt_of(n, salt=3)) == complete(cluster.mixed, prompt_of(n, salt=3))
        assert d2.metric("disagg_kv_transfer_bytes_total", direction="received") == received, "d2 took no request"
    finally:
        assert httpx.delete(f"{d2.admin_url}/drain", timeout=10.0).status_code == 401, "unsigned"
        r = d2.set_draining(False)
    assert r.json() == {"draining": False, "in_flight": 0}
    assert d2.metric("disagg_draining") == 0 and _ready(d2) == 200


def test_a_draining_prefill_is_not_ready_and_finishes_what_it_has(cluster: Cluster, processes: Any) -> None:
    prefill = cluster.pull
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, prefill, prompt_of(9), 200, True)
        processes.wait_until(lambda: prefill.metric("disagg_requests_running") >= 1, "the request runs")
        status = prefill.set_draining(True).json()
        try:
            assert status["draining"] is True and status["in_flight"] >= 1
            assert _ready(prefill) == 503
            with pytest.raises(openai.APIStatusError) as info:
                complete(prefill, prompt_of(5))
            assert info.value.status_code == 503 and "draining" in str(info.value)
            assert len(running.result(timeout=120)) == 200, "the request in flight finished"
            processes.wait_until(lambda: httpx.get(f"{prefill.admin_url}/drain").json()["in_flight"] == 0,
                                 "nothing is in flight")
        finally:
            prefill.set_draining(False)
    assert _ready(prefill) == 200


# --- faults ----------------------------------------------------------------------


@dataclass
class Stream:
    """A long streamed request in a thread: its tokens so far and how it ended."""

    tokens: list[int]
    future: concurrent.futures.Future[None]


@pytest.fixture
def long_stream(processes: Any) -> Iterator[Any]:
    pool = concurrent.futures.ThreadPoolExecutor(4)

    def start(prefill: WorkerProcess) -> Stream:
        tokens: list[int] = []

        def run() -> None:
            client = client_of(prefill)
            for chunk in client.completions.create(model=MODEL, prompt=prompt_of(13, salt=7), max_tokens=LONG,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True}):
                for choice in chunk.choices:
                    tokens.extend(getattr(choice, "token_ids", None) or [])

        stream = Stream(tokens, pool.submit(run))
        processes.wait_until(lambda: len(tokens) >= 5 or stream.future.done(), "the stream has started")
        assert not stream.future.done(), f"the stream ended early: {stream.future.exception()}"
        return stream

    yield start
    pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _linked_to_d1_alone(cluster: Cluster, processes: Any) -> Iterator[WorkerProcess]:
    """The push prefill, linked to d1 alone, for a test that unlinks d1 during a request: on the
    way out both workers' free blocks are back to their count at the start, and every link is restored."""
    prefill = cluster.push
    assert not unlink(cluster.d2, prefill)  # the request goes to d1
    start = {w.instance_name: free_blocks(w) for w in (prefill, cluster.d1)}
    try:
        yield prefill
        for w in (prefill, cluster.d1):
            processes.wait_until(lambda: free_blocks(w) == start[w.instance_name], f"{w.role}'s blocks are free")
    finally:
        for d in cluster.decodes:
            assert link(d, prefill) is None
    processes.wait_until(lambda: _ready(prefill) == 200, "the prefill is linked again")


def test_unlink_of_the_last_decode_during_a_request_finishes_it_on_the_prefill(
        cluster: Cluster, processes: Any, long_stream: Any) -> None:
    """No decode is left to move the stream to: the prefill generates the rest itself, one seamless
    stream, and every block comes back on both workers."""
    with _linked_to_d1_alone(cluster, processes) as prefill:
        stream = long_stream(prefill)
        assert not unlink(cluster.d1, prefill)
        _moves_on(stream, cluster)
    assert complete(prefill, prompt_of(6)) == complete(cluster.mixed, prompt_of(6)), "survivors serve"


@pytest.fixture(scope="module")
def unmoving_prefill(cluster: Cluster, processes: Any) -> WorkerProcess:
    """A prefill that never moves a stream (--max-migrations 0), linked to d1 alone."""
    [prefill] = processes.start(("prefill", "--max-migrations", "0"))
    assert link(cluster.d1, prefill) is None
    processes.wait_until(lambda: _ready(prefill) == 200, "the prefill is linked")
    return prefill


def test_a_response_stream_that_fails_ends_with_response_failed(cluster: Cluster, processes: Any,
                                                                unmoving_prefill: WorkerProcess) -> None:
    """/v1/responses reports a failure after its stream began in band, as OpenAI does: a
    response.failed event whose response carries the error; the blocks come back."""
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": LONG, "temperature": 0,
            "stream": True}
    whole = client_of(cluster.mixed).responses.create(**{**body, "stream": False})
    assert whole.status == "incomplete", "the greedy text must outlast the unlink below"
    prefill = unmoving_prefill
    start = {w.instance_name: free_blocks(w) for w in (prefill, cluster.d1)}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{prefill.base_url}/v1/responses", json=body, timeout=FAULT_BOUND_S) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 8:  # streaming text by now
                    assert not unlink(cluster.d1, prefill)
    for w in (prefill, cluster.d1):
        processes.wait_until(lambda: free_blocks(w) == start[w.instance_name], f"{w.role}'s blocks are free")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed", last
    assert any(w in last["response"]["error"]["message"] for w in ("went away", "unlinked", "aborted")), last


def _drain(decodes: list[WorkerProcess], on: bool) -> None:
    """Start (or end) draining these decodes: they take no new requests while draining."""
    for d in decodes:
        d.set_draining(on).raise_for_status()


def _moves_on(stream: Stream, cluster: Cluster) -> None:
    """The stream survived its decode: it ends normally with the tokens of an undisturbed run."""
    stream.future.result(timeout=FAULT_BOUND_S)
    assert stream.tokens == complete(cluster.mixed, prompt_of(13, salt=7), LONG), "one seamless stream"


def test_a_killed_decodes_stream_moves_to_another_decode(cluster: Cluster, processes: Any,
                                                         long_stream: Any) -> None:
    prefill = cluster.push
    [victim] = processes.start(("decode",))
    assert link(victim, prefill) is None
    _drain(cluster.decodes, True)  # only the victim takes new requests
    try:
        start = free_blocks(prefill)
        moved = prefill.metric("disagg_request_migrations_total", reason="lost")
        streams = [long_stream(prefill) for _ in range(3)]  # concurrent streams, all on the victim
        victim.kill()
        _drain(cluster.decodes, False)  # room to move to
        for stream in streams:
            _moves_on(stream, cluster)
        assert prefill.metric("disagg_request_migrations_total", reason="lost") == moved + 3
        processes.wait_until(lambda: free_blocks(prefill) == start, "the prefill's blocks are free")
    finally:
        _drain(cluster.decodes, False)
    assert complete(prefill, prompt_of(7)) == complete(cluster.mixed, prompt_of(7)), "survivors serve"


def test_a_killed_prefill_frees_its_requests_on_the_decode(cluster: Cluster, processes: Any,
                                                          long_stream: Any) -> None:
    decode = cluster.d1
    [victim] = processes.start(("prefill",))
    assert link(decode, victim) is None
    processes.wait_until(lambda: _ready(victim) == 200, "the victim is ready")
    start = free_blocks(decode)
    stream = long_stream(victim)
    processes.wait_until(lambda: free_blocks(decode) < start, "the decode holds the request's blocks")
    victim.kill()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        stream.future.result(timeout=FAULT_BOUND_S)
    processes.wait_until(lambda: free_blocks(decode) == start, "the decode's blocks are free", timeout=FAULT_BOUND_S)
    # The failed Generations call frees the blocks; the peer watcher drops the
    # dead link on its own schedule, so the link count is awaited, not sampled.
    processes.wait_until(lambda: decode.metric("disagg_links") == 2, "only the dead prefill's link is gone",
                         timeout=FAULT_BOUND_S)
    assert complete(cluster.push, prompt_of(8)) == complete(cluster.mixed, prompt_of(8)), "survivors serve"


def test_a_hung_decode_is_routed_around_and_its_streams_move_on(cluster: Cluster, processes: Any,
                                                                long_stream: Any) -> None:
    """SIGSTOP: alive (its connections stay open) but silent. The prefill's health checks mark
    it unhealthy within a few seconds, and its stream moves to another decode."""
    prefill = cluster.pull
    [victim] = processes.start(("decode",))
    assert link(victim, prefill) is None
    _drain(cluster.decodes, True)  # only the victim takes new requests
    try:
        start = free_blocks(prefill)
        moved = prefill.metric("disagg_request_migrations_total", reason="hung")
        streams = [long_stream(prefill) for _ in range(3)]  # concurrent streams, all on the victim
        victim.process.send_signal(signal.SIGSTOP)
        try:
            _drain(cluster.decodes, False)
            for stream in streams:
                _moves_on(stream, cluster)
            assert prefill.metric("disagg_request_migrations_total", reason="hung") == moved + 3
            assert prefill.metric("disagg_peers_unhealthy") == 1 and prefill.metric("disagg_links") == 3
            # New requests go around it at once (not after an AddNewRequests deadline on the hung one).
            assert complete(prefill, prompt_of(9)) == complete(cluster.mixed, prompt_of(9))
            processes.wait_until(lambda: free_blocks(prefill) == start, "the prefill's blocks are free")
        finally:
            victim.process.send_signal(signal.SIGCONT)
        # Answering again, it is healthy again, still linked; what it still had is refused and freed.
        processes.wait_until(lambda: prefill.metric("disagg_peers_unhealthy") == 0, "the decode is healthy again")
        assert prefill.metric("disagg_links") == 3
        processes.wait_until(lambda: victim.metric("disagg_requests_running") == 0, "the victim dropped the stream")
    finally:
        _drain(cluster.decodes, False)
        assert not unlink(victim, prefill)
        victim.kill()


def test_a_stream_its_decode_dropped_unseen_moves_on_at_the_idle_timeout(cluster: Cluster, processes: Any,
                                                                         long_stream: Any) -> None:
    """The prefill pauses longer than the decode's Generations deadline: the decode drops the
    request and cannot tell it. Once resumed, the prefill notices the silence after its idle
    timeout and moves the stream on, instead of holding the client (and a drain) forever."""
    decode = cluster.d1
    [victim] = processes.start(("prefill", "--stream-idle-timeout", "3"))
    assert link(decode, victim) is None
    processes.wait_until(lambda: _ready(victim) == 200, "the victim is ready")
    failed = decode.metric("disagg_requests_total", status="error")
    try:
        stream = long_stream(victim)
        victim.process.send_signal(signal.SIGSTOP)
        try:
            # The decode's Generations call times out (10 s): it drops the request.
            processes.wait_until(lambda: decode.metric("disagg_requests_total", status="error") == failed + 1,
                                 "the decode dropped the request", timeout=FAULT_BOUND_S)
        finally:
            victim.process.send_signal(signal.SIGCONT)
        _moves_on(stream, cluster)
        assert victim.metric("disagg_request_migrations_total", reason="idle") == 1
        processes.wait_until(lambda: victim.metric("disagg_requests_running") == 0,
                             "the prefill no longer counts the request")
    finally:
        assert not unlink(decode, victim)
        victim.kill()


def test_auto_policy_serves_short_prompts_on_the_prefill_and_says_so_in_usage(cluster: Cluster,
                                                                              processes: Any) -> None:
    [auto] = processes.start(("prefill", "--pd-policy", "auto", "--pd-local-max-tokens", "8"))
    for d in cluster.decodes:
        assert link(d, auto) is None
    processes.wait_until(lambda: _ready(auto) == 200, "the auto prefill is ready")

    def ask(prompt: list[int], stream: bool = False) -> tuple[str, list[int]]:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}
        if not stream:
            answer = httpx.post(f"{auto.base_url}/v1/completions", json=body, timeout=60).json()
            return answer["usage"]["served_by"], answer["choices"][0]["token_ids"]
        lines = httpx.post(f"{auto.base_url}/v1/completions", timeout=60, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        tokens = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or ()]
        return chunks[-1]["usage"]["served_by"], tokens

    try:
        # Nothing measured yet: a prompt longer than the local threshold is handed off.
        long = prompt_of(17, salt=5)
        assert ask(long, stream=True) == ("prefill+decode", complete(cluster.mixed, long, 6))
        for prompt, stream in ((prompt_of(6), False), (prompt_of(6, salt=5), True)):
            assert ask(prompt, stream) == ("prefill", complete(cluster.mixed, prompt, 6))
        # The long prompt again: 16 of its tokens are in the prefill's cache now, 1 is new: short.
        assert ask(long) == ("prefill", complete(cluster.mixed, long, 6))
        mixed = httpx.post(f"{cluster.mixed.base_url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prompt_of(6), "max_tokens": 2}).json()
        assert "served_by" not in mixed["usage"], "a mixed worker has nothing to say"
        assert auto.metric("disagg_pd_decision_total", decision="local") == 3
        assert auto.metric("disagg_pd_decision_total", decision="handoff") == 1
        assert auto.metric("disagg_pd_decision_reasons_total", decision="local", reason="short_prompt") == 3
        assert auto.metric("disagg_pd_decision_reasons_total", decision="handoff", reason="unmeasured") == 1
    finally:
        for d in cluster.decodes:
            assert not unlink(d, auto)
        auto.kill()
