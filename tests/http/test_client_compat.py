"""What the official `openai` client, agent frameworks (OpenAI Agents SDK,
LangChain) and vLLM's clients send, and what they expect back, on a real
mixed worker: replayed `parse()`/`.stream()` messages, explicit nulls, newer
fields, requests without `model`, OpenAI's error shapes, one `created` per
stream, CORS preflights, `chat_template_kwargs`, forced calls cut by
`max_tokens`, and strict tools with a response format.

`served` is conftest's ServedWorker (typed Any: conftest is not importable);
tool tests use the long-context worker (tool listings make long prompts).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import ModelInfo
from disagg.workers.http.prepare import prepare_chat
from disagg.workers.http.protocol import ChatCompletionRequest
from disagg.workers.http.tool_parser import parse_output
from disagg.workers.http.tools import plan_tools

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
ANSWER: dict[str, Any] = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                          "required": ["answer"], "additionalProperties": False}


class Forecast(BaseModel):
    """A function tool as the openai client's pydantic_function_tool writes it (strict)."""

    unit: Literal["C", "F"]


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.read()
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def long_http(long_context_worker: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=long_context_worker.base_url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def long_client(long_context_worker: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{long_context_worker.base_url}/v1", api_key="unused", timeout=120.0,
                       max_retries=0) as c:
        yield c


# --- 1. replayed response messages --------------------------------------------------------


def test_messages_from_parse_and_stream_helpers_replay_as_history(long_client: openai.OpenAI,
                                                                  long_context_worker: Any) -> None:
    model = long_context_worker.model
    tool = openai.pydantic_function_tool(Forecast)
    named: Any = {"type": "function", "function": {"name": "Forecast"}}
    parsed = long_client.chat.completions.parse(model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                                tools=[tool], tool_choice=named, max_tokens=100)
    with long_client.chat.completions.stream(model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                             tools=[tool], tool_choice=named, max_tokens=100) as stream:
        streamed = stream.get_final_completion()
    for message in (parsed.choices[0].message, streamed.choices[0].message):
        assert message.tool_calls and message.tool_calls[0].function.parsed_arguments is not None
        history: list[Any] = [*MESSAGES, message,
                              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        r = long_client.chat.completions.create(model=model, messages=history, tools=[tool], max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_output_only_fields_of_an_assistant_message_are_ignored(http: httpx.Client, served: Any) -> None:
    def count(messages: list[dict[str, Any]]) -> int:
        response = http.post("/tokenize", json={"model": served.model, "messages": messages})
        assert response.status_code == 200, response.text
        return int(response.json()["count"])

    call = {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "pong"}]
    replayed = [plain[0], {**plain[1], "refusal": None, "annotations": [], "audio": None, "parsed": None,
                           "reasoning_content": "thinking", "reasoning": "thinking",
                           "tool_calls": [{**call, "index": 0, "function": {"name": "ping", "arguments": "",
                                                                            "parsed_arguments": {}}}]}, plain[2]]
    assert count(replayed) == count(plain)  # ignored, and arguments "" read as {}
    r = http.post(CHAT, json={"model": served.model, "messages": replayed, "max_tokens": 2})
    assert r.status_code == 200, r.text
    # Output-only fields belong to an assistant's message: on a user's they ask for something.
    r = http.post(CHAT, json={"model": served.model, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "Hi", "annotations": [{"type": "x"}]}]})
    assert r.status_code == 400 and "messages[0].annotations" in r.json()["error"]["message"]


# --- 2. null means the default -----------------------------------------------------------


NULLS = ["n", "stream", "stream_options", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
         "stop", "user", "logit_bias", "response_format"]


def test_explicit_nulls_are_the_defaults(http: httpx.Client, served: Any) -> None:
    chat = {"model": served.model, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2,
            "max_tokens": None, "logprobs": None, "top_logprobs": None, "parallel_tool_calls": None,
            "tool_choice": None, "tools": None, **dict.fromkeys(NULLS)}
    r = http.post(CHAT, json=chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    completion = {"model": served.model, "prompt": "Hi", "max_tokens": None, "echo": None, "logprobs": None,
                  **dict.fromkeys(NULLS)}
    r = http.post(COMPLETIONS, json=completion)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16  # null max_tokens: OpenAI's default of 16
    body = {**completion, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None}}
    with http.stream("POST", COMPLETIONS, json=body) as response:
        assert all(e.get("usage") is None for e in _events(response))  # include_usage null: false


# --- 3. newer fields -----------------------------------------------------------------------


def test_fields_of_newer_clients_are_accepted(http: httpx.Client, served: Any) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
            "include_reasoning": False, "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with http.stream("POST", CHAT, json=body) as response:
        assert _events(response)[-1]["usage"]["completion_tokens"] == 2
    r = http.post(CHAT, json={**body, "stream": False, "stream_options": None,
                              "moderation": {"model": "omni-moderation-latest"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "moderation", r.text


@pytest.mark.parametrize(("spec", "check"), [
    ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"regex": "[ab]{3}"}, lambda text: re.fullmatch("[ab]{3}", text) is not None),
    ({"json": ANSWER}, lambda text: jsonschema.validate(json.loads(text), ANSWER) is None),
    ({"json": json.dumps(ANSWER)}, lambda text: jsonschema.validate(json.loads(text), ANSWER) is None),
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ({"grammar": 'start: "x" | "yz"', "regex": None}, lambda text: text in ("x", "yz")),
], ids=["choice", "regex", "json", "json-text", "json_object", "grammar"])
def test_vllm_structured_outputs_constrain_the_output(http: httpx.Client, served: Any, spec: dict[str, Any],
                                                      check: Callable[[str], bool]) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60,
            "temperature": 1.0, "seed": 3, "n": 3, "structured_outputs": spec}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert check(choice["message"]["content"]), choice


@pytest.mark.parametrize(("fields", "words"), [
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "only one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": "{not json"}}, "not JSON"),
    ({"structured_outputs": {"regex": ""}}, "regex"),
])
def test_bad_structured_outputs_are_400s(http: httpx.Client, served: Any, fields: dict[str, Any], words: str) -> None:
    r = http.post(CHAT, json={"model": served.model, "messages": [{"role": "user", "content": "Hi"}], **fields})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


# --- 5. no model ---------------------------------------------------------------------------


def test_a_request_without_model_goes_to_the_served_model(http: httpx.Client, served: Any) -> None:
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == served.model
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "model": None})
    assert r.status_code == 200 and r.json()["model"] == served.model, r.text
    assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


# --- 6. error shapes and created -------------------------------------------------------------


def test_an_unknown_model_is_openais_404(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert error == http.get("/v1/models/gpt-17").json()["error"] | {"message": error["message"], "param": "model"}


def test_every_chunk_of_a_stream_carries_one_created(http: httpx.Client, served: Any) -> None:
    # Long enough to cross a second: a re-stamped chunk would differ.
    body = {"model": served.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400,
            "ignore_eos": True, "n": 4, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", CHAT, json=body) as response:
        events = _events(response)
    assert len({e["created"] for e in events}) == 1


# --- 7. CORS --------------------------------------------------------------------------------


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_preflight_is_answered(http: httpx.Client) -> None:
    r = http.options(CHAT, headers=PREFLIGHT)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers
    simple = http.get("/v1/models", headers={"Origin": "https://app.example"})
    assert simple.headers["access-control-allow-origin"] == "*"


def test_the_cors_flags_narrow_what_browsers_may_do(tiny_model_dir: Path, tmp_path: Path,
                                                    worker_launcher: Callable[..., Any]) -> None:
    flags = ["--allowed-origins", '["https://app.example"]', "--allowed-methods", '["POST"]',
             "--allowed-headers", '["authorization", "content-type"]', "--allow-credentials", "--api-key", "k"]
    context: contextlib.AbstractContextManager[Any] = worker_launcher(str(tiny_model_dir), tmp_path / "w.log", *flags)
    with context as worker, httpx.Client(base_url=worker.base_url, timeout=30.0) as c:
        r = c.options(CHAT, headers=PREFLIGHT)  # no key: browsers send none in a preflight
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert c.options(CHAT, headers={**PREFLIGHT, "Origin": "https://evil.example"}).status_code == 400
        assert c.options(CHAT, headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}).status_code == 400


# --- 4. chat_template_kwargs ---------------------------------------------------------------


# A template that reads a variable of its own, as Qwen3's reads enable_thinking.
THINKING_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
                     "not enable_thinking %} <think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    tokenizer.hf.chat_template = THINKING_TEMPLATE
    tokenizer = Tokenizer(tokenizer.hf)
    model = ModelInfo(name="m", source="m", max_model_len=512, vocab_size=tokenizer.vocab_size)

    def prompt(**fields: Any) -> str:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                                    **fields})
        return tokenizer.decode(prepare_chat(req, model, tokenizer).prompt_token_ids, skip_special_tokens=False)

    assert prompt().endswith("assistant:")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith("assistant: <think></think>")
    assert prompt(chat_template_kwargs={"enable_thinking": True}).endswith("assistant:")


def test_chat_template_kwargs_on_the_server(http: httpx.Client, served: Any) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http.post(CHAT, json={**body, "chat_template_kwargs": {"enable_thinking": False}}).status_code == 200
    for bad, words in (([1], "chat_template_kwargs"), ({"add_generation_prompt": False}, "add_generation_prompt")):
        r = http.post(CHAT, json={**body, "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert words in r.json()["error"]["message"]


# --- 9. forced calls cut by max_tokens --------------------------------------------------------


def _cut_budget(long_model_dir: Path) -> int:
    """max_tokens that ends a forced get_weather call inside its arguments."""
    head = '<tool_call>\n{"name":"get_weather","arguments":{"city":"'
    return len(Tokenizer.from_dir(long_model_dir).encode(head, add_special_tokens=False)) + 2


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_a_call(long_http: httpx.Client, long_context_worker: Any,
                                                   long_model_dir: Path, choice: Any) -> None:
    body = {"model": long_context_worker.model, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": choice,
            "max_tokens": _cut_budget(long_model_dir), "temperature": 0}
    r = long_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice_ = r.json()["choices"][0]
    assert choice_["finish_reason"] == "length"
    assert choice_["message"]["content"] is None
    [call] = choice_["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith('{"city":"')
    with long_http.stream("POST", CHAT, json={**body, "stream": True}) as response:
        chunks = [e["choices"][0] for e in _events(response)]
    assert all(not c["delta"].get("content") for c in chunks), chunks  # no markup leaks as text
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls") or []]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
           [("get_weather", call["function"]["arguments"])]
    assert chunks[-1]["finish_reason"] == "length"


def test_a_cut_opening_tag_after_forced_calls_is_dropped() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": [WEATHER],
                                                "tool_choice": "required"})
    plan = plan_tools(req)
    assert plan is not None
    whole = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}\n</tool_call>'
    content, calls = parse_output(plan, f"{whole}\n<tool_ca")
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    content, calls = parse_output(plan, '<tool_call>\n{"name":"get_w')  # a name cut short: its one function
    assert content is None and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""


# --- 8. strict tools with a response format --------------------------------------------------


def test_strict_tools_with_a_json_schema_answer_or_call(long_http: httpx.Client, long_context_worker: Any) -> None:
    """The Agents SDK's request for an agent with function tools and an output_type."""
    fmt = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True, "schema": ANSWER}}
    body = {"model": long_context_worker.model, "messages": MESSAGES, "tools": [STRICT_WEATHER],
            "response_format": fmt, "max_tokens": 120, "temperature": 1.0, "seed": 4, "n": 6}
    r = long_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        message = choice["message"]
        if choice["finish_reason"] == "stop":  # the answer, in the response format
            assert message["tool_calls"] is None
            jsonschema.validate(json.loads(message["content"]), ANSWER)
        elif choice["finish_reason"] == "tool_calls":  # or calls only
            assert message["content"] is None
            for call in message["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_ARGS)


def test_required_with_json_object_makes_calls(long_http: httpx.Client, long_context_worker: Any) -> None:
    body = {"model": long_context_worker.model, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
            "response_format": {"type": "json_object"}, "parallel_tool_calls": False, "max_tokens": 120}
    r = long_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER_ARGS)
