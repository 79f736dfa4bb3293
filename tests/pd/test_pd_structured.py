"""Structured outputs through PD (issue 16 item 2): the prefill samples the
first token under the grammar, the grammar travels in our sampling-extras
metadata, and the decode rebuilds the matcher from it and the first token.
Output equals one engine's and validates, PUSH and PULL."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from disagg.workers.engine.grammar import GrammarKind, build_grammar
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.convert import sampling_extras_metadata, with_sampling_extras
from disagg.workers.pd.messages import NewRequest

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 2, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
]
PROMPT = [11, 23, 5, 77, 130, 9]


async def _collect(pair: Any, req_id: str, params: SamplingParams) -> tuple[list[int], str]:
    tokens: list[int] = []
    text = ""
    async for out in pair.prefill.role.generate(req_id, PROMPT, params):
        tokens += out.new_token_ids
        text += out.new_text
    return tokens, text


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_constrained_output_through_pd_equals_one_engine_and_validates(
        pd_pair: Callable[..., Any], reference_tokens: Callable[..., list[int]], mode: str) -> None:
    async with pd_pair(mode) as pair:
        for i, schema in enumerate(SCHEMAS):
            grammar = build_grammar(GrammarKind.JSON_SCHEMA, schema)
            for j, params in enumerate((SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar),
                                        SamplingParams(max_tokens=80, temperature=1.0, seed=7, grammar=grammar))):
                tokens, text = await _collect(pair, f"s{i}-{j}", params)
                assert tokens == reference_tokens(PROMPT, params), (schema, params.temperature)
                jsonschema.validate(json.loads(text), schema)


def test_the_grammar_travels_in_the_sampling_extras_and_a_bad_one_is_refused() -> None:
    grammar = build_grammar(GrammarKind.REGEX, "[0-9]{3}")
    sent = [NewRequest("a", [1, 2], SamplingParams(grammar=grammar), "p:1"), NewRequest("b", [3], SamplingParams(), "p:1")]
    plain = [NewRequest(r.req_id, r.prompt_token_ids, SamplingParams(), "p:1") for r in sent]
    received = with_sampling_extras(plain, sampling_extras_metadata(sent))
    assert [r.params.grammar for r in received] == [grammar, None]
    bad = (("x-disagg-sampling-extras", json.dumps({"a": {"grammar": 5}})),)
    with pytest.raises(ValueError, match="grammar must be a string"):
        with_sampling_extras(plain, bad)
