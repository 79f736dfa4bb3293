"""Tool calling through PD (issue 16 item 3), with the `openai` client on the
prefill's own HTTP app: enforced calls (`required`, a named function) ride
the sampling extras as a grammar, as structured outputs do, and each answer
(calls, content, finish reason, token ids; streamed too) equals a mixed
engine's, PUSH and PULL. The worker and engines are real and in this process;
the apps are reached through httpx's ASGI transport (conftest's `openai_client`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from disagg.testing.tiny_model import build_tiny_model
from disagg.workers.engine.config import EngineConfig
from disagg.workers.http.backend import Backend, LocalEngineBackend

CONTEXT = 2048  # the tool listing makes long prompts with the tiny tokenizer
ENGINE: dict[str, Any] = {"max_model_len": CONTEXT, "num_kv_blocks": 1024, "dtype": "float32"}  # as pd_pair's
FLIGHT_ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "route": {"type": "object", "properties": {"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                   "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                  "required": ["from", "to"], "additionalProperties": False},
        "seats": {"type": "array", "items": {"enum": ["aisle", "window"]}, "minItems": 1, "maxItems": 2},
        "price": {"type": "number", "minimum": 0, "maximum": 999},
    },
    "required": ["route", "seats", "price"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "book_flight", "parameters": FLIGHT_ARGS}},
    {"type": "function", "function": {"name": "cancel", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "Book me a flight."}]
FORCED = 'Sure.\n<tool_call>\n{"name":"cancel","arguments":{"ok":true}}\n</tool_call>'
CASES: list[dict[str, Any]] = [
    {"tool_choice": {"type": "function", "function": {"name": "book_flight"}}},
    {"tool_choice": "required"},
    {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": 5},
    {"tool_choice": "auto", "extra_body": {"guided_choice": [FORCED], "return_token_ids": True}},
    {"tool_choice": "none", "max_tokens": 24},
    {"tools": [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS],
     "temperature": 1.0, "seed": 9, "max_tokens": 60},
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides the session's model for this module (pd_pair serves it): more positions."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("long-model"), context=CONTEXT)


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path) -> Iterator[LocalEngineBackend]:
    backend = LocalEngineBackend.from_config(
        EngineConfig(model=str(tiny_model_dir), device="cpu", block_size=4, **ENGINE), "tiny")
    yield backend
    backend.close()


async def _answer(client: openai.AsyncOpenAI, fields: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One greedy (unless the case says) choice: calls (name, arguments), content, finish reason, token ids."""
    model = (await client.models.list()).data[0].id
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 150,
                            "temperature": 0, **fields}
    body["extra_body"] = {"return_token_ids": True, **body.get("extra_body", {})}
    if stream:
        # The client's own delta accumulation (its stream helpers' state), which unlike
        # `.stream()` keeps answers cut by max_tokens too.
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        token_ids: list[int] = []
        async for chunk in await client.chat.completions.create(stream=True, **body):
            state.handle_chunk(chunk)
            for c in chunk.choices:
                token_ids += getattr(c, "token_ids", None) or []
        choice: Any = state.current_completion_snapshot.choices[0]
    else:
        choice = (await client.chat.completions.create(**body)).choices[0]
        token_ids = choice.token_ids
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    return {"calls": calls, "content": choice.message.content, "finish": choice.finish_reason, "tokens": token_ids}


async def _answers(client: openai.AsyncOpenAI) -> AsyncIterator[dict[str, Any]]:
    async with client:
        for fields in CASES:
            for stream in (False, True):
                yield await _answer(client, fields, stream)


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_tool_calls_through_pd_equal_the_mixed_role(pd_pair: Callable[..., Any], mixed: LocalEngineBackend,
                                                          openai_client: Callable[[Backend, str], openai.AsyncOpenAI],
                                                          mode: str) -> None:
    expected = [a async for a in _answers(openai_client(mixed, "mixed"))]
    async with pd_pair(mode, **ENGINE) as pair:
        got = [a async for a in _answers(openai_client(pair.prefill.backend, "prefill"))]
    assert got == expected
    assert expected[0::2] == expected[1::2]  # streamed as whole
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named, required, single, auto, none, strict = (expected[2 * i] for i in range(len(CASES)))
    assert [name for name, _ in named["calls"]] == ["book_flight"] and named["finish"] == "tool_calls"
    assert required["calls"] and len(single["calls"]) == 1 and single["finish"] == "tool_calls"
    for answer in (named, required, single):
        assert answer["content"] is None
        for name, arguments in answer["calls"]:
            jsonschema.validate(arguments, schemas[name])
    assert auto == {"calls": [("cancel", {"ok": True})], "content": "Sure.", "finish": "tool_calls",
                    "tokens": auto["tokens"]}
    assert none["calls"] == [] and none["content"]
    for name, arguments in strict["calls"]:
        jsonschema.validate(arguments, schemas[name])
