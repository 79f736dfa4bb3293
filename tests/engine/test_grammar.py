"""Structured outputs in the engine: a tiny random model under a grammar still
yields valid output (validity must not depend on the model), and a batch that
mixes constrained and unconstrained rows leaves the unconstrained ones alone."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.grammar import GrammarKind, Grammars, build_grammar, closed_objects
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.outputs import FinishReason
from disagg.workers.engine.sampling_params import SamplingParams

# Bounded strings and arrays, so that a random model always reaches the end within MAX_TOKENS.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object",
                                                "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                                               "y": {"type": "boolean"}},
                                                "required": ["x", "y"], "additionalProperties": False},
                                      "id": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}},
     "required": ["point", "id"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"enum": ["alpha", "beta", 3, None]},
]
REQUESTS_PER_SCHEMA = 4
MAX_TOKENS = 120


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                              block_size=4, num_kv_blocks=512))


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str, Any]]:
    """(tokens, text, final output) of each request, all submitted at once."""
    results: dict[str, tuple[list[int], list[str], list[Any]]] = {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
        results[f"r{i}"] = ([], [], [])
    for _ in range(5000):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            tokens, text, final = results[out.request_id]
            tokens += out.new_token_ids
            text.append(out.new_text)
            final[:] = [out]
    assert not engine.has_unfinished_requests, "the engine made no progress"
    return [(t, "".join(x), f[0]) for t, x, f in results.values()]


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., Path]) -> LLMEngine:
    return _engine(tiny_model("llama"))


PROMPT = [5, 17, 42, 99, 7]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_every_output_validates_under_its_schema(engine: LLMEngine, schema: dict[str, Any]) -> None:
    grammar = build_grammar(GrammarKind.JSON_SCHEMA, schema)
    requests = [(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=grammar))
                for i in range(REQUESTS_PER_SCHEMA)]
    requests.append((PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)))
    for _, text, final in _run(engine, requests):
        assert final.finish_reason is FinishReason.STOP, (final.finish_reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_choice_and_regex_hold(engine: LLMEngine) -> None:
    choices = ["yes", "no", "maybe so"]
    choice = build_grammar(GrammarKind.CHOICE, choices)
    regex = r"[A-Z]{2}-[0-9]{3}(\.[a-z]+)?"
    by_regex = build_grammar(GrammarKind.REGEX, regex)
    requests = [(PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=g))
                for i in range(4) for g in (choice, by_regex)]
    results = _run(engine, requests)
    for (_, text, _), (_, params) in zip(results, requests):
        if params.grammar == choice:
            assert text in choices
        else:
            assert re.fullmatch(regex, text), text


def test_any_json_object(engine: LLMEngine) -> None:
    grammar = build_grammar(GrammarKind.JSON_OBJECT, None)
    requests = [(PROMPT, SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar))]
    (_, text, final), = _run(engine, requests)
    if final.finish_reason is FinishReason.STOP:  # a random model may write a long object
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine: LLMEngine) -> None:
    plain = [([3 + i, 50, 60 + i], SamplingParams(max_tokens=12, temperature=t, seed=i, ignore_eos=True))
             for i, t in enumerate((0.0, 1.0, 0.7))]
    alone = [tokens for tokens, _, _ in _run(engine, plain)]
    grammar = build_grammar(GrammarKind.JSON_SCHEMA, SCHEMAS[0])
    constrained = [(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, grammar=grammar))]
    mixed = _run(engine, [*plain, *constrained, *constrained])
    assert [tokens for tokens, _, _ in mixed[:3]] == alone


def test_logprobs_of_a_constrained_row_are_over_the_allowed_tokens(engine: LLMEngine) -> None:
    grammar = build_grammar(GrammarKind.CHOICE, ["yes", "no"])
    engine.add_request("lp", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, logprobs=20, grammar=grammar))
    logprobs = []
    for _ in range(50):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            logprobs += out.new_logprobs or []
    first = logprobs[0]
    allowed = [(t, v) for t, v in first.top if v > float("-inf")]
    # After the mask (as vLLM reports them): the few tokens that start "yes" or "no" share all the mass.
    assert 2 <= len(allowed) < 20
    assert sum(math.exp(v) for _, v in allowed) == pytest.approx(1.0, abs=1e-4)
    assert first.token_id == allowed[0][0] and first.logprob == allowed[0][1]


def test_compiled_grammars_are_cached_and_bounded(engine: LLMEngine) -> None:
    assert engine.tokenizer is not None
    grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size, capacity=2)
    texts = [build_grammar(GrammarKind.CHOICE, [f"c{i}"]) for i in range(3)]
    for text in texts:
        grammars.constraint(text)
    assert list(grammars._compiled) == texts[1:]  # the oldest went
    a, b = grammars.constraint(texts[2]), grammars.constraint(texts[2])
    a.advance(int(a.allowed().nonzero()[0]))
    assert not (a.allowed() == b.allowed()).all(), "copies share no state"


def _accepts(grammars: Grammars, grammar: str, token_ids: list[int]) -> bool:
    """Whether the grammar allows these tokens, one after the other."""
    constraint = grammars.constraint(grammar)
    for token_id in token_ids:
        if not constraint.allowed()[token_id]:
            return False
        constraint.advance(token_id)
    return True


def test_an_object_that_lists_its_properties_allows_no_others_unless_it_says_so(engine: LLMEngine) -> None:
    assert engine.tokenizer is not None
    grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size)
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    extra, exact = (engine.tokenizer.encode(text, add_special_tokens=False) for text in ('{"x":1,"y":2}', '{"x":1}'))
    schemas = {
        "closed": point,
        "nested, closed": {"type": "array", "items": {"type": "object", "properties": {"p": point}}},
        "open": {**point, "additionalProperties": True},
        "open to integers": {**point, "additionalProperties": {"type": "integer"}},
    }
    accepted = {name: _accepts(grammars, build_grammar(GrammarKind.JSON_SCHEMA, schema), extra)
                for name, schema in schemas.items() if not name.startswith("nested")}
    assert accepted == {"closed": False, "open": True, "open to integers": True}
    assert _accepts(grammars, build_grammar(GrammarKind.JSON_SCHEMA, point), exact)
    nested = build_grammar(GrammarKind.JSON_SCHEMA, schemas["nested, closed"])
    inner_extra = engine.tokenizer.encode('[{"p":{"x":1,"y":2}}]', add_special_tokens=False)
    assert not _accepts(grammars, nested, inner_extra)
    assert _accepts(grammars, nested, engine.tokenizer.encode('[{"p":{"x":1}}]', add_special_tokens=False))


def test_closing_objects_leaves_what_the_schema_composes_alone() -> None:
    part = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = {"allOf": [part, {"properties": {"b": {"type": "string"}}}],
              "$defs": {"p": part}, "properties": {"q": {"$ref": "#/$defs/p", "properties": {"c": {}}}}}
    closed = closed_objects(schema)
    assert closed["allOf"] == schema["allOf"]  # an allOf's branches stay open: each adds properties
    assert "additionalProperties" not in closed  # it takes allOf
    assert closed["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["q"]  # beside a $ref
    assert closed_objects({"enum": [{"properties": 1}]}) == {"enum": [{"properties": 1}]}  # values are not schemas
    assert "additionalProperties" not in part  # the caller's schema is not changed
