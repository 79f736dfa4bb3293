"""OpenAI's Responses API (`/v1/responses`) with the `openai` client, on a real
mixed worker with a tiny random model: a response is the chat path's answer to
the same conversation (greedy, so the texts are equal), streamed events build
exactly the final response, tools come back as function_call items and go
back in as input items, and every request the server cannot honour is a 400
that names its field. PD: tests/pd/test_pd_processes.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

WEATHER_ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "A city's forecast", "parameters": WEATHER_ARGS}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def served(long_context_worker: Any) -> Any:
    return long_context_worker


def _chat(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], max_tokens: int, **fields: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0, **fields)


def test_a_response_is_the_chat_answer_to_the_same_conversation(client: openai.OpenAI, served: Any) -> None:
    r = client.responses.create(model=served.model, input="Tell me about Paris.", max_output_tokens=12,
                                temperature=0, metadata={"run": "1"})
    chat = _chat(client, served.model, [{"role": "user", "content": "Tell me about Paris."}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == served.model
    assert r.output_text == chat.choices[0].message.content
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.usage is not None and chat.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"run": "1"} and r.max_output_tokens == 12 and r.store is False
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens" and message.status == "incomplete"
    else:
        assert r.status == "completed" and message.status == "completed"


def test_instructions_and_message_items_are_the_chat_messages(client: openai.OpenAI, served: Any) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello! How can I help?", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a "}, {"type": "input_text", "text": "city."}]},
    ]
    r = client.responses.create(model=served.model, instructions="Be brief.", input=items, max_output_tokens=8,
                                temperature=0)
    chat = _chat(client, served.model, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a city."},
    ], 8)
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Be brief."
    assert r.usage is not None and chat.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens


def _stream(client: openai.OpenAI, **body: Any) -> list[Any]:
    with client.responses.create(stream=True, **body) as events:
        return list(events)


def test_streamed_events_build_the_whole_response(client: openai.OpenAI, served: Any) -> None:
    body = {"model": served.model, "input": "Count to ten.", "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**body)
    events = _stream(client, **body)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage is not None and whole.usage is not None
    # the second asking of the same prompt finds it in the prefix cache: cached_tokens differ
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert final.output[0].id == events[2].item.id  # the item the deltas named


def test_the_stream_helper_accumulates_the_response(client: openai.OpenAI, served: Any) -> None:
    # The helper's final response needs response.completed: a text that ends before max_output_tokens.
    city = {"type": "json_schema", "name": "city", "schema": {"enum": ["Paris", "Rome"]}}
    body = {"model": served.model, "input": "A city?", "max_output_tokens": 20, "temperature": 0,
            "text": {"format": city}}
    with client.responses.stream(**body) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(text) in ("Paris", "Rome")
    assert final.output_text == text == client.responses.create(**body).output_text


def test_a_named_function_comes_back_as_a_function_call_item(client: openai.OpenAI, served: Any) -> None:
    body: dict[str, Any] = {"model": served.model, "input": "Weather in Paris?", "tools": [TOOL],
                            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 200,
                            "temperature": 1.0}
    r = client.responses.create(**body)
    assert r.status == "completed", r
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    assert r.tools[0].type == "function" and r.tools[0].name == "get_weather"
    events = _stream(client, **body)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    [item] = [e.item for e in events if e.type == "response.output_item.done"]
    assert len(done) == 1 and done[0].arguments == item.arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(item.arguments), WEATHER_ARGS)


def test_function_calls_and_their_outputs_go_back_in_as_items(client: openai.OpenAI, served: Any) -> None:
    arguments = '{"city": "Paris", "days": 1}'
    r = client.responses.create(model=served.model, tools=[TOOL], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        # As a history of the client's model_dump() replays it: with the item's null fields.
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments,
         "id": "fc_1", "status": "completed", "namespace": None, "caller": None, "async": None},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ])
    chat = _chat(client, served.model, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ], 8, tools=[CHAT_TOOL])
    assert r.usage is not None and chat.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_a_json_schema_format_constrains_the_text(client: openai.OpenAI, served: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    r = client.responses.create(model=served.model, input="A name, as JSON.", max_output_tokens=60, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "nothing is stored"),
    ({"conversation": "conv_1"}, "conversation", "nothing is stored"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning mode"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "truncation auto"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "input[0]: reasoning"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "input[0]: an item reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input", "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "ns"}]},
     "input", "input[0].namespace"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "name": "f", "parameterz": {}}]}, "tools", "tools[0].parameterz"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"frobnicate": 1}, "frobnicate", "unrecognized"),
])
def test_what_cannot_be_honoured_is_a_400_naming_its_field(served: Any, fields: dict[str, Any], param: str,
                                                          words: str) -> None:
    body = {"model": served.model, "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(f"{served.base_url}/v1/responses", json=body, timeout=60.0)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_harmless_fields_are_accepted_and_the_worker_keeps_serving(served: Any) -> None:
    body = {"model": served.model, "input": "hi", "max_output_tokens": 4, "store": True, "include": [
        "reasoning.encrypted_content"], "reasoning": {"effort": None}, "service_tier": "auto", "truncation": "disabled",
        "prompt_cache_key": "k", "background": False}
    r = httpx.post(f"{served.base_url}/v1/responses", json=body, timeout=60.0)
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False  # what the response says: nothing was stored
    other = httpx.post(f"{served.base_url}/v1/responses", json={**body, "model": "other"}, timeout=60.0)
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
