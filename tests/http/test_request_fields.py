"""Nothing a client sends is silently ignored (issue 16 item 1): each field
that is not implemented gets a 400 in OpenAI's shape naming it (`param`),
unless its value asks for nothing; harmless fields are accepted. Against a
real mixed worker, with the `openai` client and raw httpx.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from disagg.workers.http.fields import HARMLESS, REFUSED, Refused
from disagg.workers.http.responses import HARMLESS as RESPONSES_HARMLESS, REFUSED as RESPONSES_REFUSED

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]

# (endpoint, field, a value that asks for something the server does not do)
REFUSED_CASES = [
    (CHAT, "function_call", "auto"),
    (CHAT, "tool_choice", "required"),  # with no tools
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "response_format", {"type": "xml"}),
    (CHAT, "guided_regex", "[a-"),
    (CHAT, "guided_decoding_backend", "xgrammar"),
    (CHAT, "logit_bias", {"5": 101}),
    (COMPLETIONS, "logit_bias", {"99999": -100}),
    (COMPLETIONS, "best_of", 3),
    (COMPLETIONS, "suffix", "the end"),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "echo", True),
    (COMPLETIONS, "prompt_logprobs", 21),
    (COMPLETIONS, "min_tokens", 3),  # more than max_tokens
    (CHAT, "guided_choice", []),
    (COMPLETIONS, "guided_json", {"type": "wat"}),
    (CHAT, "use_beam_search", True),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "chat_template", "{{ messages }}"),
    (COMPLETIONS, "priority", 5),
    (COMPLETIONS, "no_stop_trim", True),
    (CHAT, "return_hidden_states", True),
]

# (endpoint, field, a value that asks for nothing: accepted)
NOOP_CASES = [
    (CHAT, "tool_choice", "none"),
    (CHAT, "tools", []),
    (CHAT, "response_format", {"type": "text"}),
    (CHAT, "logit_bias", {}),
    (COMPLETIONS, "best_of", 1),
    (COMPLETIONS, "suffix", None),
    (CHAT, "modalities", ["text"]),
    (COMPLETIONS, "min_tokens", 0),
    (CHAT, "echo", False),
    (CHAT, "parallel_tool_calls", True),
    # what sglang-router adds to every request it forwards (issue 17)
    (COMPLETIONS, "no_stop_trim", False),
    (COMPLETIONS, "return_hidden_states", False),
    (CHAT, "no_stop_trim", False),
]


def _body(path: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 2}
    base.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Hello"})
    return {**base, **fields}


def _assert_refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == field, error
    assert field in error["message"], error


@pytest.mark.parametrize(("path", "field", "value"), REFUSED_CASES, ids=[f"{c[1]}-{c[0][4:]}" for c in REFUSED_CASES])
def test_unimplemented_field_is_refused_by_name(http: httpx.Client, path: str, field: str, value: Any) -> None:
    _assert_refused(http.post(path, json=_body(path, **{field: value})), field)


@pytest.mark.parametrize(("path", "field", "value"), NOOP_CASES, ids=[f"{c[1]}-{c[0][4:]}" for c in NOOP_CASES])
def test_field_that_asks_for_nothing_is_accepted(http: httpx.Client, path: str, field: str, value: Any) -> None:
    response = http.post(path, json=_body(path, **{field: value}))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field", sorted(HARMLESS))
def test_harmless_field_is_accepted(http: httpx.Client, field: str) -> None:
    value = {"metadata": {"k": "v"}, "store": True, "parallel_tool_calls": False}.get(field, "x")
    response = http.post(CHAT, json=_body(CHAT, **{field: value}))
    assert response.status_code == 200, response.text


# the fields sglang-router 0.3.2 (regular mode) writes into a chat request it forwards, as captured
SGLANG_ROUTER_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False}


def test_a_request_as_sglang_router_forwards_it_is_accepted(http: httpx.Client) -> None:
    response = http.post(CHAT, json=_body(CHAT, **SGLANG_ROUTER_CHAT))
    assert response.status_code == 200, response.text


def test_unknown_field_is_refused_as_unrecognized(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, json=_body(COMPLETIONS, frobnicate=1))
    _assert_refused(response, "frobnicate")
    assert "unrecognized" in response.json()["error"]["message"]
    # a chat-only field on the completions endpoint is unknown there
    _assert_refused(http.post(COMPLETIONS, json=_body(COMPLETIONS, max_completion_tokens=2)), "max_completion_tokens")


def test_message_fields_null_is_accepted_and_a_value_refused(http: httpx.Client) -> None:
    replayed = [*MESSAGES, {"role": "assistant", "content": "Hi", "refusal": None, "audio": None},
                {"role": "user", "content": "again"}]
    assert http.post(CHAT, json=_body(CHAT, messages=replayed)).status_code == 200
    # A prompt-caching mark on a message, as on a content part, and an assistant's refusal part.
    hinted = [{"role": "system", "content": "Be brief.", "cache_control": {"type": "ephemeral"}},
              {"role": "user", "content": [{"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]},
              {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
              {"role": "user", "content": "again"}]
    assert http.post(CHAT, json=_body(CHAT, messages=hinted)).status_code == 200
    refused_by_user = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    response = http.post(CHAT, json=_body(CHAT, messages=refused_by_user))
    assert response.status_code == 400 and "'refusal'" in response.json()["error"]["message"]
    response = http.post(CHAT, json=_body(CHAT, messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert response.status_code == 400 and "needs its 'text' string" in response.json()["error"]["message"]
    bad = [{"role": "user", "content": "Hello", "audio": {"id": "a1"}}]
    response = http.post(CHAT, json=_body(CHAT, messages=bad))
    assert response.status_code == 400 and "messages[0].audio" in response.json()["error"]["message"]
    response = http.post(CHAT, json=_body(CHAT, stream_options={"include_usage": True, "frob": 1}, stream=True))
    assert response.status_code == 400 and "frob" in response.json()["error"]["message"]


def test_openai_client_gets_a_bad_request_naming_the_field(client: openai.OpenAI, served: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       functions=[{"name": "f"}], function_call="auto")
    assert caught.value.param in ("functions", "function_call")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=served.model, prompt="Hi", max_tokens=2, logit_bias={"7": 500})
    assert caught.value.param == "logit_bias"
    ok = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                        user="u1", metadata={"a": "b"}, store=False, service_tier="auto")
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(("harmless", "refused"), [(HARMLESS, REFUSED), (RESPONSES_HARMLESS, RESPONSES_REFUSED)],
                         ids=["completions", "responses"])
def test_every_refused_field_has_a_reason_and_no_field_is_in_both_tables(harmless: dict[str, str],
                                                                         refused: dict[str, Refused]) -> None:
    assert not set(harmless) & set(refused)
    assert all(r.reason for r in refused.values())


def test_the_api_doc_names_every_field_of_the_tables() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "openai-api.md").read_text()
    names = (*HARMLESS, *REFUSED, *RESPONSES_HARMLESS, *RESPONSES_REFUSED)
    missing = [name for name in names if f"`{name}`" not in doc]
    assert not missing, f"docs/openai-api.md does not name {missing}"
