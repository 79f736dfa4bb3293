"""Structured outputs, 100 out of 100 (issue 16 item 2), with the `openai` client:
on a mixed engine and on a PD pair in PUSH and PULL, 100 constrained requests
per setup over a varied set of JSON schemas, `json_object`, `guided_regex` and
`guided_choice`, sent 25 at a time so constrained requests share steps. Every
output ends by itself (`stop`, never cut) and validates, and every one (greedy
or seeded) through PD is the mixed engine's text.

The weights are random, so every string and number is bounded (maxLength, a
pattern, an enum, multipleOf): otherwise a sampled string would close only by
the chance of drawing a quote, about 1 in 300 tokens. The engines and the
worker are real and in this process; the apps are reached through httpx's
ASGI transport (conftest's `openai_client`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from disagg.workers.engine.config import EngineConfig
from disagg.workers.http.backend import Backend, LocalEngineBackend

# 25 requests at once, never preempted; fp32 as pd_pair's, so the mixed engine's tokens are PD's on an AMX CPU too
ENGINE: dict[str, Any] = {"num_kv_blocks": 2048, "max_model_len": 512, "dtype": "float32"}
BATCH = 25
MAX_TOKENS = 200


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": _object({
        "user": _object({"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        "active": {"type": "boolean"},
    }),
    "arrays": _object({
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "points": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                   "minItems": 2, "maxItems": 4},
    }),
    "enums": _object({"size": {"enum": ["S", "M", "L", "XL"]}, "unit": {"type": "string", "enum": ["cm", "in"]},
                      "level": {"enum": [1, 2, 3, None]}}),
    "patterns": _object({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                         "day": {"type": "string", "pattern": "^2026-(0[1-9]|1[0-2])-[0-2][0-9]$"}}),
    "numbers": _object({"count": {"type": "integer", "minimum": -5, "maximum": 5},
                        "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
                        "score": {"type": "number", "exclusiveMinimum": -10, "maximum": 10, "multipleOf": 0.5}}),
    "optional": _object({"title": {"type": "string", "maxLength": 12}, "note": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}, required=["title"]),
    "list_of_objects": _object({"items": {"type": "array", "maxItems": 3, "items": _object(
        {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "ok": {"type": "boolean"}}, required=["id"])}}),
}
REGEX = r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["alpha", "beta", "gamma", "delta"]
# Request i has kind KINDS[i % 10]: json_object's are requests 5, 15, ..., 95 (see `_cases`).
KINDS = [*list(SCHEMAS)[:5], "json_object", *list(SCHEMAS)[5:], "regex", "choice"]


@dataclass(frozen=True)
class Case:
    """One request: its constraint (`kind`), and greedy or seeded sampling."""

    index: int
    kind: str
    seed: int | None  # None: greedy

    @property
    def prompt(self) -> str:
        return f"Request {self.index}: answer as asked."

    def check(self, text: str) -> None:
        """AssertionError (or jsonschema's) unless `text` is what the constraint allows."""
        if self.kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif self.kind == "choice":
            assert text in CHOICES, text
        elif self.kind == "json_object":
            assert isinstance(json.loads(text), dict), text
        else:
            jsonschema.validate(json.loads(text), SCHEMAS[self.kind])


def _cases() -> list[Case]:
    """100 requests over KINDS: a quarter greedy, the rest at temperature 1 with distinct seeds.
    `json_object` allows strings of any length, which a random model's sampling never closes:
    those are greedy, on prompts whose greedy object closes (as `{}`) on the tiny model."""
    cases = []
    for i in range(100):
        kind = KINDS[i % len(KINDS)]
        greedy = i % 4 == 0 or kind == "json_object"
        cases.append(Case(i, kind, None if greedy else 1000 + i))
    return cases


CASES = _cases()


async def _text(client: openai.AsyncOpenAI, model: str, case: Case) -> str:
    """One request's output, through the API form its kind takes (chat or completions,
    OpenAI's `response_format` or vLLM's `guided_*`); asserts it was not cut."""
    sampling: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0.0 if case.seed is None else 1.0,
                                "seed": case.seed}
    messages: Any = [{"role": "user", "content": case.prompt}]
    if case.kind in SCHEMAS and case.index % 3 == 0:  # vLLM's form, on completions
        c = await client.completions.create(model=model, prompt=case.prompt, **sampling,
                                            extra_body={"guided_json": SCHEMAS[case.kind]})
        choice: Any = c.choices[0]
        text = choice.text
    elif case.kind == "regex":
        c = await client.completions.create(model=model, prompt=case.prompt, **sampling,
                                            extra_body={"guided_regex": REGEX})
        choice, text = c.choices[0], c.choices[0].text
    else:
        fields: dict[str, Any]
        if case.kind == "choice":
            fields = {"extra_body": {"guided_choice": CHOICES}}
        elif case.kind == "json_object":
            fields = {"response_format": {"type": "json_object"}}
        else:
            fields = {"response_format": {"type": "json_schema", "json_schema": {
                "name": case.kind, "schema": SCHEMAS[case.kind], "strict": True}}}
        r = await client.chat.completions.create(model=model, messages=messages, **sampling, **fields)
        choice, text = r.choices[0], r.choices[0].message.content or ""
    assert choice.finish_reason == "stop", (case, text)
    return str(text)


async def _texts(client: openai.AsyncOpenAI) -> list[str]:
    """Every case's output, BATCH requests at a time."""
    model = (await client.models.list()).data[0].id
    texts: list[str] = []
    for start in range(0, len(CASES), BATCH):
        texts += await asyncio.gather(*(_text(client, model, case) for case in CASES[start:start + BATCH]))
    return texts


def _check_all(texts: list[str]) -> None:
    for case, text in zip(CASES, texts, strict=True):
        case.check(text)


@pytest.fixture(scope="module")
def mixed_texts(tiny_model_dir: Path, openai_client: Callable[[Backend, str], openai.AsyncOpenAI]) -> Iterator[list[str]]:
    backend = LocalEngineBackend.from_config(
        EngineConfig(model=str(tiny_model_dir), device="cpu", block_size=4, **ENGINE), "tiny")

    async def run() -> list[str]:
        async with openai_client(backend, "mixed") as client:
            return await _texts(client)

    try:
        yield asyncio.run(run())
    finally:
        backend.close()


def test_every_constrained_output_of_a_mixed_engine_stops_and_validates(mixed_texts: list[str]) -> None:
    _check_all(mixed_texts)
    assert len(set(mixed_texts)) > 60  # sampled outputs vary
    assert {c.kind for c in CASES} == set(KINDS) and sum(c.seed is None for c in CASES) < 40


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_every_constrained_output_through_pd_validates_and_equals_the_mixed_one(
        pd_pair: Callable[..., Any], openai_client: Callable[[Backend, str], openai.AsyncOpenAI],
        mixed_texts: list[str], mode: str) -> None:
    async with pd_pair(mode, **ENGINE) as pair, openai_client(pair.prefill.backend, "prefill") as client:
        texts = await _texts(client)
    _check_all(texts)
    assert texts == mixed_texts
