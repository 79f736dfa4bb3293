"""Structured outputs through the API with the `openai` client, on a real
mixed worker with a tiny random model: each output validates, whatever the
weights (issue 16 item 2). PD is covered in tests/pd/test_pd_structured.py.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
        "sizes": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1,
                  "maxItems": 2},
        "kind": {"enum": ["town", "village"]},
    },
    "required": ["city", "rank", "sizes", "kind"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


def test_json_schema_response_format_validates(client: openai.OpenAI, served: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=150,  # type: ignore[arg-type]
                                       temperature=1.0, seed=3, n=3, response_format=fmt)  # type: ignore[arg-type]
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_streamed_json_object_is_an_object(client: openai.OpenAI, served: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    stream = client.completions.create(model=served.model, prompt="JSON:", max_tokens=50, temperature=0, stream=True,
                                       extra_body={"guided_json": json.dumps(schema)})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert json.loads(text) in ({"a": True}, {"a": False})
    r = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=300,  # type: ignore[arg-type]
                                       temperature=0, response_format={"type": "json_object"})
    content = r.choices[0].message.content or ""
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":  # a random model may write past max_tokens
        assert isinstance(json.loads(content), dict)


def test_guided_choice_and_regex(client: openai.OpenAI, served: Any) -> None:
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=10, n=3,  # type: ignore[arg-type]
                                       temperature=1.0, seed=5, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    regex = r"\d{3}-[a-z]{2,3}"
    c = client.completions.create(model=served.model, prompt="code:", max_tokens=12, temperature=1.0, seed=1,
                                  extra_body={"guided_regex": regex}, logprobs=2)
    assert re.fullmatch(regex, c.choices[0].text), c.choices[0].text
    assert c.choices[0].logprobs is not None
    assert all(lp > float("-inf") for lp in c.choices[0].logprobs.token_logprobs or [])


def test_bad_constraints_are_400s_naming_the_field(http: httpx.Client) -> None:
    body: dict[str, Any] = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),  # the second one named
        ({"guided_choice": ["a"], "ignore_eos": True}, "guided_choice"),
    ]
    for extra, field in cases:
        response = http.post("/v1/chat/completions", json={**body, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == field, (extra, response.json())
