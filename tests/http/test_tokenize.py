"""vLLM's /tokenize and /detokenize on a real worker: the counts the completion
endpoints report, round trips, and 4xx answers in OpenAI's shape.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it in Paris?"}]


def _usage(http: httpx.Client, path: str, body: dict[str, Any]) -> int:
    response = http.post(path, json={**body, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens"])


def test_a_prompt_counts_as_completions_reads_it_and_comes_back(http: httpx.Client, served: Any) -> None:
    text = "The capital of France is"
    r = http.post("/tokenize", json={"model": served.model, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == _usage(http, "/v1/completions", {"model": served.model,
                                                                                    "prompt": text})
    assert len(body["token_strs"]) == body["count"] and body["max_model_len"] > body["count"]
    bare = http.post("/tokenize", json={"model": served.model, "prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == body["tokens"][-bare["count"]:]  # the same text, without what the tokenizer adds
    back = http.post("/detokenize", json={"model": served.model, "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "with tools"])
def test_messages_count_as_chat_renders_them(http: httpx.Client, served: Any, tools: list[Any] | None) -> None:
    fields: dict[str, Any] = {"model": served.model, "messages": MESSAGES}
    if tools:
        fields["tools"] = tools
    r = http.post("/tokenize", json=fields)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == _usage(http, "/v1/chat/completions", fields)


def test_tools_make_the_prompt_longer(http: httpx.Client, served: Any) -> None:
    plain, tooled = (http.post("/tokenize", json={"model": served.model, "messages": MESSAGES, **extra}).json()
                     for extra in ({}, {"tools": TOOLS}))
    assert tooled["count"] > plain["count"]


@pytest.mark.parametrize("path, fields, param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "a", "frob": 1}, "frob"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
], ids=["both", "neither", "tools with a prompt", "special tokens with messages", "no messages", "unknown field",
        "token out of the vocabulary", "tokens not a list"])
def test_bad_requests_are_400s_in_openais_shape(http: httpx.Client, served: Any, path: str, fields: dict[str, Any],
                                                param: str) -> None:
    r = http.post(path, json={"model": served.model, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert http.post("/tokenize", json={"model": served.model, "prompt": "still serving"}).status_code == 200


def test_another_model_is_a_404(http: httpx.Client) -> None:
    r = http.post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
