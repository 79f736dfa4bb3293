"""Tool calling through the chat API with the `openai` client, on a real mixed
worker with a tiny random model (issue 16 item 3): every `tool_choice` mode,
parallel calls, history with calls and results, streamed call deltas, and 400s
for bad tool requests. `required` and named calls are enforced, so their
arguments validate whatever the weights; `auto` output is parsed, so those
tests force the model's text with `guided_choice`. PD: tests/pd/test_pd_tools.py.

The tool listing makes long prompts with the tiny byte-level tokenizer, so
these tests serve a tiny model of 2048 positions (`served`, a ServedWorker of
conftest, typed Any: conftest is not importable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import ModelInfo
from disagg.workers.http.prepare import prepare_chat
from disagg.workers.http.protocol import ChatCompletionRequest
from disagg.workers.http.tools import format_call

WEATHER_ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["C", "F"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TIME_ARGS: dict[str, Any] = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                             "required": ["zone"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "A city's forecast",
                                      "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}},
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = format_call("get_weather", {"city": "Paris", "days": 2, "unit": "C"})
# What a model writes when it answers in text and then calls two tools (forced with guided_choice).
TEXT_AND_CALLS = f"Let me look.\n{CALL}\n{format_call('get_time', {'zone': 'CET'})}"
HISTORY: list[dict[str, Any]] = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1, "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def served(long_context_worker: Any) -> Any:
    return long_context_worker


def _chat(client: openai.OpenAI, model: str, **fields: Any) -> Any:
    body: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
    body.update(fields)
    return client.chat.completions.create(model=model, **body)


def _assert_valid_calls(message: Any) -> list[tuple[str, Any]]:
    """Each call is an offered function with arguments valid under its schema; returns (name, arguments)."""
    calls = []
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function", call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_a_named_function_is_called_with_arguments_valid_under_its_schema(client: openai.OpenAI, served: Any) -> None:
    r = _chat(client, served.model, n=3, temperature=1.0, seed=11,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert [name for name, _ in _assert_valid_calls(choice.message)] == ["get_weather"]


def test_required_makes_one_or_more_calls_and_parallel_false_exactly_one(client: openai.OpenAI, served: Any) -> None:
    r = _chat(client, served.model, n=4, temperature=1.0, seed=1, tool_choice="required")
    counts = []
    for choice in r.choices:
        calls = _assert_valid_calls(choice.message)
        counts.append(len(calls))
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
        else:  # a random model may chain calls until max_tokens: the cut block stays text
            assert choice.finish_reason == "length" and "<tool_call>" in (choice.message.content or "")
    assert min(counts) >= 1 and max(counts) > 1, counts  # parallel calls happen with this seed
    r = _chat(client, served.model, n=4, temperature=1.0, seed=1, tool_choice="required", parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(_assert_valid_calls(choice.message)) == 1, choice


def test_auto_parses_calls_out_of_the_text(client: openai.OpenAI, served: Any) -> None:
    r = _chat(client, served.model, extra_body={"guided_choice": [TEXT_AND_CALLS]})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look."
    assert _assert_valid_calls(message) == [("get_weather", {"city": "Paris", "days": 2, "unit": "C"}),
                                            ("get_time", {"zone": "CET"})]
    # parallel_tool_calls false: the first call only; what follows stays text
    r = _chat(client, served.model, parallel_tool_calls=False, extra_body={"guided_choice": [TEXT_AND_CALLS]})
    assert [name for name, _ in _assert_valid_calls(r.choices[0].message)] == ["get_weather"]
    assert r.choices[0].message.content == "Let me look.\n" + format_call("get_time", {"zone": "CET"})
    # a call of a function that was not offered is not a call
    unknown = format_call("launch", {})
    r = _chat(client, served.model, extra_body={"guided_choice": [unknown]})
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == unknown
    assert r.choices[0].finish_reason == "stop"


def test_auto_with_a_strict_function_writes_text_or_valid_calls(client: openai.OpenAI, served: Any) -> None:
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    r = _chat(client, served.model, tools=strict, n=4, temperature=1.0, seed=2, max_tokens=120)
    for choice in r.choices:
        _assert_valid_calls(choice.message)
        if choice.finish_reason != "length":  # the grammar lets no broken call through
            assert "<tool_call>" not in (choice.message.content or ""), choice


def test_none_offers_no_tools_and_parses_nothing(client: openai.OpenAI, served: Any) -> None:
    plain = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    r = _chat(client, served.model, tool_choice="none", max_tokens=12)
    assert r.usage and plain.usage
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # no tool preamble in the prompt
    assert r.choices[0].message.content == plain.choices[0].message.content and r.choices[0].message.tool_calls is None
    auto = _chat(client, served.model, max_tokens=12)
    assert auto.usage
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # auto shows the model the tools
    r = _chat(client, served.model, tool_choice="none", extra_body={"guided_choice": [CALL]})
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None


def _streamed(client: openai.OpenAI, model: str, **fields: Any) -> tuple[Any, list[Any], int]:
    """The final message the client's stream helper assembles, the raw tool-call deltas, and
    the chunks that carried nothing (no delta, finish reason, logprobs or token ids)."""
    body: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
    body.update(fields)
    deltas, empty = [], 0
    with client.chat.completions.stream(model=model, **body) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                choice = event.chunk.choices[0]
                deltas += choice.delta.tool_calls or []
                empty += not (choice.delta.model_dump(exclude_none=True) or choice.finish_reason or choice.logprobs
                              or (choice.model_extra or {}).get("token_ids"))
        return stream.get_final_completion(), deltas, empty


@pytest.mark.parametrize("fields", [
    {"extra_body": {"guided_choice": [TEXT_AND_CALLS]}},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
], ids=["auto", "required", "named"])
def test_streamed_tool_calls_reassemble_to_the_whole_response(client: openai.OpenAI, served: Any,
                                                              fields: dict[str, Any]) -> None:
    whole = _chat(client, served.model, **fields).choices[0]
    final, deltas, empty = _streamed(client, served.model, **fields)
    assert empty == 0  # the text of a call held back while it is parsed sends no chunk
    streamed = final.choices[0]
    assert streamed.finish_reason == whole.finish_reason
    assert streamed.message.content == whole.message.content
    assert _assert_valid_calls(streamed.message) == _assert_valid_calls(whole.message)
    assert deltas and all(d.id and d.type == "function" and d.function.name for d in deltas)
    assert [d.index for d in deltas] == list(range(len(whole.message.tool_calls)))


def test_history_with_calls_and_results_is_accepted(client: openai.OpenAI, served: Any) -> None:
    r = _chat(client, served.model, messages=HISTORY, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shorter = _chat(client, served.model, max_tokens=8)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens


# --- the prompt, rendered here (no server) ----------------------------------------


def _prompt(model_dir: Path, body: dict[str, Any], template: str | None = None) -> str:
    tokenizer = Tokenizer.from_dir(model_dir)
    if template is not None:
        tokenizer.hf.chat_template = template
        tokenizer = Tokenizer(tokenizer.hf)
    model = ModelInfo(name="m", source="m", max_model_len=4096, vocab_size=tokenizer.vocab_size)
    req = ChatCompletionRequest.model_validate({"model": "m", **body})
    return tokenizer.decode(prepare_chat(req, model, tokenizer).prompt_token_ids, skip_special_tokens=False)


def test_a_template_without_tools_gets_our_format(long_model_dir: Path) -> None:
    prompt = _prompt(long_model_dir, {"messages": HISTORY, "tools": TOOLS})
    listed = [json.dumps(t["function"], separators=(",", ":")) for t in TOOLS]
    assert f"<tools>\n{listed[0]}\n{listed[1]}\n</tools>" in prompt  # the tools, in the system turn
    assert format_call("get_weather", {"city": "Paris", "days": 1, "unit": "C"}) in prompt  # the earlier call
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>" in prompt  # its result
    assert prompt.endswith("<|im_start|>assistant\n")
    no_tools = _prompt(long_model_dir, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in no_tools and "<tool_response>" in no_tools  # the history still shows


# Reads tools, calls (arguments as objects) and results as Hugging Face's tool templates do.
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
    "{% if m.role == 'tool' %} FOR {{ m.tool_call_id }} {{ m.name }}{% endif %};{% endfor %}"
)


def test_a_template_with_tools_gets_them_and_the_history_in_its_own_form(long_model_dir: Path) -> None:
    prompt = _prompt(long_model_dir, {"messages": HISTORY, "tools": TOOLS}, TOOL_TEMPLATE)
    assert prompt == ("TOOL get_weather\nTOOL get_time\nuser: What is the weather in Paris?;"
                      "assistant: CALL get_weather Paris;tool: sunny, 21 C FOR call_1 get_weather;")


# --- errors ---------------------------------------------------------------------


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **({} if parameters is None else {"parameters": parameters})}}


BAD: list[tuple[dict[str, Any], str, str]] = [  # (fields, param, words of the message)
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not among"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [_tool("f", {"type": "array"})]}, "tools", "must be a JSON schema of an object"),
    ({"tools": [_tool("f", {"type": "object", "properties": {"a": {"type": "wat"}}})]}, "tools", "not a usable JSON schema"),
    ({"tools": [_tool("f"), _tool("f")]}, "tools", "is not unique"),
    ({"tools": [_tool("a b")]}, "tools", "letters, digits"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages", "needs a tool_call_id"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c9", "content": "x"}]}, "messages", "no earlier"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages", "JSON object"),
    ({"tool_choice": "required", "ignore_eos": True}, "tool_choice", "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}], "guided_regex": "a+"},
     "tool_choice", "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools and tool_choice"),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_400s_in_openais_shape(http: httpx.Client, fields: dict[str, Any], param: str,
                                                     words: str) -> None:
    body = {"model": "tiny-llama", "messages": MESSAGES, "tools": [_tool("get_weather", WEATHER_ARGS)],
            "max_tokens": 4, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["param"] == param, error
    assert words in error["message"], error
