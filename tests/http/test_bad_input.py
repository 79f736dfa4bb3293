"""Bad input gets a 4xx OpenAI-shaped error; the worker keeps serving, and no
request, finished, refused or abandoned, keeps KV blocks.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from disagg.testing.tiny_model import VOCAB_SIZE

LONG_TEXT = "Hello world! How are you today? " * 200  # far past the 512-token context
SETTLE_TIMEOUT_S = 30.0


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
NAN = float("nan")

# (id, path, body as JSON text, words the message must contain)
BAD_INPUTS = [
    ("malformed-json", COMPLETIONS, '{"model": "tiny-llama", "prompt": ', "not valid JSON"),
    ("malformed-json-chat", CHAT, "[1, 2", "not valid JSON"),
    ("not-an-object", COMPLETIONS, "[1, 2, 3]", ""),
    ("missing-prompt", COMPLETIONS, json.dumps({"model": "tiny-llama"}), "prompt"),
    ("unknown-model", COMPLETIONS, json.dumps(_completion(model="gpt-17")), "gpt-17"),
    ("unknown-model-chat", CHAT, json.dumps(_chat(model="gpt-17")), "gpt-17"),
    ("empty-prompt", COMPLETIONS, json.dumps(_completion(prompt="")), "empty"),
    ("empty-token-list", COMPLETIONS, json.dumps(_completion(prompt=[])), "empty"),
    ("empty-messages", CHAT, json.dumps(_chat(messages=[])), "empty"),
    ("negative-max-tokens", COMPLETIONS, json.dumps(_completion(max_tokens=-3)), "max_tokens"),
    ("zero-max-tokens-chat", CHAT, json.dumps(_chat(max_tokens=0)), "max_tokens"),
    ("huge-max-tokens", COMPLETIONS, json.dumps(_completion(max_tokens=10**12)), "max_tokens"),
    ("huge-max-tokens-chat", CHAT, json.dumps(_chat(max_tokens=100000)), "max_tokens"),
    ("temperature-too-high", COMPLETIONS, json.dumps(_completion(temperature=9.5)), "temperature"),
    ("temperature-negative", CHAT, json.dumps(_chat(temperature=-1)), "temperature"),
    ("temperature-nan", COMPLETIONS, json.dumps(_completion(temperature=NAN)), "temperature"),
    ("top-p-too-high", COMPLETIONS, json.dumps(_completion(top_p=1.5)), "top_p"),
    ("top-p-zero", CHAT, json.dumps(_chat(top_p=0)), "top_p"),
    ("top-p-nan", CHAT, json.dumps(_chat(top_p=NAN)), "top_p"),
    ("n-too-large", COMPLETIONS, json.dumps(_completion(n=1000)), "n must be"),
    ("n-zero", CHAT, json.dumps(_chat(n=0)), "n must be"),
    ("token-id-past-vocab", COMPLETIONS, json.dumps(_completion(prompt=[1, 2, 10**6])), "1000000"),
    ("negative-token-id", COMPLETIONS, json.dumps(_completion(prompt=[5, -1])), "-1"),
    ("prompt-past-context", COMPLETIONS, json.dumps(_completion(prompt=LONG_TEXT)), "context"),
    ("messages-past-context", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": LONG_TEXT}])), "context"),
    ("logprobs-too-many", COMPLETIONS, json.dumps(_completion(logprobs=50)), "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, json.dumps(_chat(top_logprobs=2)), "logprobs"),
    ("wrong-type", COMPLETIONS, json.dumps(_completion(max_tokens="many")), "max_tokens"),
    ("prompt-batch-too-large", COMPLETIONS, json.dumps(_completion(prompt=["a"] * 65)), "at most 64 prompts"),
    ("prompt-batch-empty-item", COMPLETIONS, json.dumps(_completion(prompt=["a", ""])), "must not be empty"),
    ("prompt-batch-of-ids-outside", COMPLETIONS, json.dumps(_completion(prompt=[[1], [99999]])), "token ids"),
    # Hostile input (issue 15): each was a 5xx, an aborted batch, or accepted.
    ("lone-surrogate", COMPLETIONS, json.dumps(_completion(prompt="Hi \ud800 there")), "JSON"),
    ("lone-surrogate-chat", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": "\ud800"}])), "JSON"),
    ("top-k-2-pow-63", COMPLETIONS, json.dumps(_completion(top_k=2**63, temperature=1)), "top_k"),
    ("top-k-past-vocab", CHAT, json.dumps(_chat(top_k=VOCAB_SIZE + 1)), "top_k"),
    ("stop-token-negative", COMPLETIONS, json.dumps(_completion(stop_token_ids=[-1])), "stop_token_ids"),
    ("stop-token-past-vocab", COMPLETIONS, json.dumps(_completion(stop_token_ids=[VOCAB_SIZE])), "stop_token_ids"),
    ("stop-token-2-pow-31", CHAT, json.dumps(_chat(stop_token_ids=[2**31])), "stop_token_ids"),
    ("seed-past-int64", COMPLETIONS, json.dumps(_completion(seed=2**70)), "seed"),
    ("token-id-true", COMPLETIONS, json.dumps(_completion(prompt=[5, True])), "prompt"),
    ("stream-yes", COMPLETIONS, json.dumps(_completion(stream="yes")), "stream"),
    ("stream-yes-chat", CHAT, json.dumps(_chat(stream="yes")), "stream"),
    ("null-content", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": None}])), "null"),
    ("missing-content", CHAT, json.dumps(_chat(messages=[{"role": "user"}])), "null"),
    ("unknown-role", CHAT, json.dumps(_chat(messages=[{"role": "wizard", "content": "hi"}])), "wizard"),
    ("assistant-tool-calls", CHAT, json.dumps(_chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
    ])), "tool_calls.0.function"),  # a call without its function
]


@pytest.fixture(scope="module")
def baseline_free_blocks(served: Any) -> Iterator[Callable[[], float]]:
    """The free-block count before this module's tests; checked again after them."""

    def read() -> float:
        text = httpx.get(f"{served.base_url}/metrics", timeout=10.0).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("disagg_kv_blocks_free ")))

    start = read()
    assert start > 0
    yield read
    assert _settle(read, start) == start, "KV blocks leaked: the free count did not return to its start"


def _settle(read: Callable[[], float], target: float) -> float:
    """Poll a metric until it reaches `target` (aborts finish asynchronously), bounded."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    value = read()
    while value != target and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def _assert_openai_error(response: httpx.Response, words: str) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["message"], str) and error["message"]
    # OpenAI's code: the status, or the name it gives the error (an unknown model, a prompt past the context).
    assert error["code"] in (response.status_code, "model_not_found", "context_length_exceeded")
    assert words.lower() in error["message"].lower(), error["message"]
    return error


@pytest.mark.parametrize(("path", "body", "words"), [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_4xx_openai_error(
    http: httpx.Client, baseline_free_blocks: Callable[[], float], path: str, body: str, words: str
) -> None:
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    _assert_openai_error(response, words)
    # ...and the worker still serves.
    ok = http.post(COMPLETIONS, json=_completion(temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


# (id, path, body, the field the error must name: the one the client sent)
NAMED_AS_SENT = [
    ("top-logprobs-too-many", CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("max-completion-tokens-past-context", CHAT, _chat(max_tokens=None, max_completion_tokens=100000),
     "max_completion_tokens"),
    ("max-completion-tokens-zero", CHAT, _chat(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
    ("max-output-tokens-zero", "/v1/responses", {"model": "tiny-llama", "input": "hi", "max_output_tokens": 0},
     "max_output_tokens"),
    ("logit-bias-unicode-digit", CHAT, _chat(logit_bias={"\u00b2": 1}), "logit_bias"),  # "2" superscript: isdigit()
    ("stream-options-without-stream", CHAT, _chat(stream_options={"include_usage": True}), "stream_options"),
    ("stream-options-without-stream-completion", COMPLETIONS, _completion(stream_options={"include_usage": True}),
     "stream_options"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in NAMED_AS_SENT], ids=[c[0] for c in NAMED_AS_SENT])
def test_the_error_names_the_field_as_the_client_sent_it(http: httpx.Client, path: str, body: dict[str, Any],
                                                         param: str) -> None:
    error = _assert_openai_error(http.post(path, json=body), param)
    assert error["param"] == param, error


def test_unknown_model_is_404(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, json=_completion(model="nope"))
    assert response.status_code == 404
    error = _assert_openai_error(response, "nope")
    # OpenAI's shape, as GET /v1/models/{id} answers it.
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, _completion(prompt=LONG_TEXT), "prompt"),
    (CHAT, _chat(messages=[{"role": "user", "content": LONG_TEXT}]), "messages"),
    (CHAT, _chat(max_tokens=None, max_completion_tokens=100000), "max_completion_tokens"),
], ids=["prompt", "messages", "max-completion-tokens"])
def test_past_the_context_is_openais_context_length_exceeded(http: httpx.Client, path: str, body: dict[str, Any],
                                                             param: str) -> None:
    """The code and opening words OpenAI and vLLM use, which clients match to trim a history."""
    error = _assert_openai_error(http.post(path, json=body), "the prompt has")
    assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, "), error


def test_a_bad_max_tokens_is_named_alone(http: httpx.Client) -> None:
    """Not also min_tokens, which the client never sent (its default was checked against the bad value)."""
    error = _assert_openai_error(http.post(COMPLETIONS, json=_completion(max_tokens=-3)), "max_tokens")
    assert "min_tokens" not in error["message"], error


def test_unknown_route_is_an_openai_404(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/nothing-here"), "not found")


def test_disconnected_stream_frees_its_blocks(
    served: Any, http: httpx.Client, baseline_free_blocks: Callable[[], float]
) -> None:
    start = baseline_free_blocks()
    aborted = _aborted_requests(http)
    body = _completion(prompt="Hello world! " * 8, max_tokens=400, n=2, stream=True, temperature=0, ignore_eos=True)
    with httpx.Client(base_url=served.base_url, timeout=60.0) as streamer:
        with streamer.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        # Leaving the block closes the connection mid-stream.
    assert _settle(baseline_free_blocks, start) == start
    assert "\ndisagg_requests_running 0.0" in http.get("/metrics").text
    assert _settle(lambda: _aborted_requests(http), aborted + 1) == aborted + 1


def _aborted_requests(http: httpx.Client) -> float:
    prefix = 'disagg_requests_total{role="mixed",status="aborted"} '
    return float(next(line[len(prefix):] for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)))


def test_disconnected_whole_request_frees_its_blocks(
    served: Any, http: httpx.Client, baseline_free_blocks: Callable[[], float]
) -> None:
    start = baseline_free_blocks()
    aborted = _aborted_requests(http)
    body = _completion(max_tokens=500, temperature=0, ignore_eos=True)
    # A client that gives up long before 500 tokens on a CPU are done.
    with httpx.Client(base_url=served.base_url, timeout=httpx.Timeout(60.0, read=0.3)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(COMPLETIONS, json=body)
    assert _settle(baseline_free_blocks, start) == start
    assert _settle(lambda: _aborted_requests(http), aborted + 1) == aborted + 1
